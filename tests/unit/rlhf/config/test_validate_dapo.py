"""`algorithm.estimator: dapo` means DAPO's recipe: a config that names it without its parts is refused,
naming each missing part, before anything starts."""

import pytest

from rlhf.config import ConfigError, load_run_config
from rlhf.schema import Estimator, LossAggregation


def _load(tmp_path, *overrides):
    (tmp_path / "run.yaml").write_text("{}")
    return load_run_config(tmp_path / "run.yaml", list(overrides))


def test_dapo_without_its_parts_names_each_missing_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "algorithm.estimator=dapo", "algorithm.loss_aggregation=seq_mean_token_mean")
    msg = str(e.value)
    assert "3 problems" in msg
    assert "algorithm.clip_eps_high = 0.2: estimator dapo clips higher" in msg
    assert "algorithm.loss_aggregation = 'seq_mean_token_mean'" in msg
    assert "algorithm.dynamic_sampling = False: estimator dapo keeps only groups whose rewards differ" in msg


def test_dapo_with_its_parts_loads(tmp_path):
    cfg = _load(tmp_path, "algorithm.estimator=dapo", "algorithm.clip_eps_high=0.28", "algorithm.dynamic_sampling=true")
    a = cfg.algorithm
    assert a.estimator is Estimator.dapo and a.loss_aggregation is LossAggregation.token_mean and a.dynamic_sampling


def test_grpo_takes_the_same_options_one_by_one(tmp_path):
    assert _load(tmp_path, "algorithm.clip_eps_high=0.28").algorithm.estimator is Estimator.grpo


def test_stale_sync_needs_a_behaviour_weight_and_co_located_turns_refuse_partial_rollouts(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm.tis_cap = 0.0: stale_sync.max_staleness > 0 trains on samples"):
        _load(tmp_path, "stale_sync.max_staleness=1")
    with pytest.raises(ConfigError, match="token-level importance weight"):
        _load(tmp_path, "stale_sync.max_staleness=1", "algorithm.estimator=gspo")
    # co-located (the default placement) with sleeping engines: the roles take turns, no sync meets a generation
    with pytest.raises(ConfigError, match=r"stale_sync.partial_rollout = True: the engines and the trainer share "
                                          r"device\(s\) 0.*take turns"):
        _load(tmp_path, "stale_sync.max_staleness=1", "algorithm.tis_cap=2", "stale_sync.partial_rollout=true")
    turns = _load(tmp_path, "stale_sync.max_staleness=1", "algorithm.tis_cap=2")  # co-located, taking turns
    awake = _load(tmp_path, "stale_sync.max_staleness=1", "algorithm.tis_cap=2", "rollout.sleep_level=0",
                  "stale_sync.partial_rollout=true")  # co-located, both resident: syncs can meet generations
    apart = _load(tmp_path, "stale_sync.max_staleness=2", "algorithm.tis_cap=2", "placement.colocate=false")
    assert (turns.rollout.sleep_level, awake.stale_sync.partial_rollout, apart.stale_sync.max_staleness) == (2, True, 2)


def test_r2_replay_needs_an_old_logprob_forward():
    """trainer.routing_replay=old on an on-policy update (one mini-batch, one epoch) has nothing to replay."""
    from pathlib import Path

    CONFIGS = Path(__file__).resolve().parents[4] / "configs"
    on_policy = ["trainer.routing_replay=old", "trainer.mini_batch_size=512"]  # 32 prompts x 16 samples
    with pytest.raises(ConfigError, match=r"trainer.routing_replay.*on-policy.*use rollout"):
        load_run_config(CONFIGS / "tiny_cpu.yaml", on_policy)
    load_run_config(CONFIGS / "tiny_cpu.yaml", on_policy + ["trainer.epochs=2"])
    load_run_config(CONFIGS / "tiny_cpu.yaml", ["trainer.routing_replay=old"])  # 4 mini-batches
