"""A step's metrics from the roles' typed replies: the numbers a user reads in W&B, computed in-process.
A renamed reply field fails here, not in an end-to-end run."""

from pathlib import Path

import pytest
import torch

from actors.replies import ReceiveReply, SendReply, SyncReplies, UpdateReply, UpdateStats
from actors.vllm.engine import Completion
from rlhf.batch import TokenBatch
from rlhf.config import load_model_config
from rlhf.driver.metrics import expert_load, expert_parallel_load, progress_fields, step_metrics, update_metrics
from rlhf.driver.rollout import Rollout
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.trainer import trainer_shard_spec
from rlhf.parity import logprob_parity
from weight_sync.plan import Topology, plan_reshard

TINY = Path(__file__).resolve().parents[4] / "configs" / "model" / "qwen3_moe_tiny.yaml"


def _stats(tokens, clip, loss=0.5):
    return UpdateStats(loss=loss, grad_norm=2.0, optimizer_steps=4, lr=1e-3, clip_fraction=clip, ratio_mean=1.0,
                       kl=0.0, entropy=1.5, tokens=tokens)


def test_update_metrics_weight_ranks_by_tokens():
    updates = [UpdateReply(_stats(30.0, 0.1), [[4, 4]], 0.0, 1.0), UpdateReply(_stats(10.0, 0.5), None, 0.0, 3.0)]
    m = update_metrics(updates)
    assert m["actor/clip_fraction"] == pytest.approx((30 * 0.1 + 10 * 0.5) / 40)
    assert m["actor/loss"] == 0.5 and m["actor/grad_norm"] == 2.0 and m["actor/optimizer_steps"] == 4


def test_expert_load_is_busiest_over_mean():
    m = expert_load([UpdateReply(_stats(1.0, 0.0), [[1, 3], [2, 2]], 0.0, 1.0)])
    assert m["expert_load/layer0_max_over_mean"] == 1.5 and m["expert_load/layer1_max_over_mean"] == 1.0
    assert m["expert_load/max_over_mean"] == 1.5


def test_ep_rank_load_and_the_load_prediction():
    """4 experts on 2 EP ranks (0, 1 | 2, 3): layer 0 puts 30 of 40 tokens on rank 0; the prediction made before
    a step is scored against that step's loads, then moved toward them."""
    reply = UpdateReply(_stats(1.0, 0.0), [[10, 20, 5, 5], [10, 10, 10, 10]], 0.0, 1.0)
    m, pred = expert_parallel_load([reply], [(0, 0, 1, 1)] * 2, 2, None)
    assert m == {"expert_load/layer0_ep_rank_max_over_mean": 1.5, "expert_load/layer1_ep_rank_max_over_mean": 1.0,
                 "expert_load/ep_rank_max_over_mean": 1.5}
    assert pred == [[10, 20, 5, 5], [10, 10, 10, 10]]
    reply2 = UpdateReply(_stats(1.0, 0.0), [[20, 10, 5, 5], [10, 10, 10, 10]], 0.0, 1.0)
    m2, pred2 = expert_parallel_load([reply2], [(0, 0, 1, 1)] * 2, 2, pred)
    assert abs(m2["expert_load/prediction_error"] - 20 / 80) < 1e-12
    assert pred2[0] == pytest.approx([11, 19, 5, 5])
    m1, _ = expert_parallel_load([reply], [(0, 0, 0, 0)] * 2, 1, None)
    assert m1 == {}  # one expert shard: nothing to balance, no prediction yet
    assert expert_load([UpdateReply(_stats(1.0, 0.0), None, 0.0, 1.0)]) == {}
    # each layer under its own map (after a migration), and each pipeline stage's rank reporting its own layers
    stage0, stage1 = (UpdateReply(_stats(1.0, 0.0), [r], 0.0, 1.0) for r in ([10, 20, 5, 5], [10, 10, 10, 10]))
    m3, pred3 = expert_parallel_load([stage0, UpdateReply(_stats(1.0, 0.0), None, 0.0, 1.0), stage1],
                                     [(0, 1, 0, 1), (0, 0, 1, 1)], 2, None)
    assert m3["expert_load/layer0_ep_rank_max_over_mean"] == 25 / 20 and pred3 == pred
    with pytest.raises(ValueError, match="2 expert maps for the 1 MoE layers"):
        expert_parallel_load([stage0], [(0, 1, 0, 1)] * 2, 2, None)


def test_step_metrics_from_replies():
    comps = [Completion(0, (5, 2), (-0.1, -0.2), "stop", 3), Completion(0, (5, 6, 7), (-0.3, -0.4, -0.5), "length", 3)]
    ro = Rollout(rows=[object()], prompt_ids=[[1, 4]], completions=comps, rewards_PG=torch.tensor([[1.0, 0.0]]),
                 scores_PG=torch.tensor([[1.0, 0.0]]), groups_drawn=2, generate_seconds=2.0, reward_seconds=0.1,
                 generated_tokens=5)
    batch = TokenBatch.from_samples([[1, 4], [1, 4]], [c.token_ids for c in comps], [c.logp for c in comps])
    parity = logprob_parity(batch.rollout_logp_BT, batch.rollout_logp_BT, batch.mask_BT)
    cfg = load_model_config(TINY)
    plan = plan_reshard(trainer_shard_spec(cfg, Layout(dp=2)), engine_shard_spec(cfg, InferenceLayout(1), rank_offset=2),
                        Topology.single_node(3))
    sync = SyncReplies([SendReply(100, 0, 0, 0.0, 0.2), SendReply(50, 20, 0, 0.0, 0.3)],
                       [ReceiveReply(3, 150, 20, 120, 7, 0.25, 0.1, 0.0, 0.4)])
    updates = [UpdateReply(_stats(5.0, 0.2), [[1, 1]], 0.0, 1.5)]
    m = step_metrics(ro, batch, torch.ones(2, 4), parity, updates, sync, plan, Topology.single_node(3), 4.0,
                     {"offload": 11})
    assert m["reward/mean"] == 0.5 and m["accuracy/train"] == 0.5
    assert m["response/length_mean"] == 2.5 and m["response/truncated_fraction"] == 0.5
    assert m["rollout/groups_drawn"] == 2 and m["rollout/groups_kept"] == 1
    assert m["parity/max_abs_diff"] == 0.0
    assert m["time/sync"] == 0.4 and m["time/sync_transfer"] == 0.25 and m["time/sync_install"] == 0.1
    assert m["time/update"] == 1.5 and m["time/step"] == 4.0
    assert m["sync/bytes_received"] == 150 and m["sync/bytes_shm"] == 20 and m["sync/bytes_in_place"] == 120
    assert m["sync/bytes_sent"] == 150 and m["sync/checked_transfers"] == 7 and m["sync/version"] == 3
    assert m["sync/bytes_minimal"] == plan.bytes_minimal > 0
    assert m["sync/floor_seconds"] == plan.floor_seconds(Topology.single_node(3))
    assert m["throughput/generate_tokens_per_s"] == 2.5
    assert m["offload/bytes"] == 11 and m["onload/bytes"] == 0
    assert m["actor/clip_fraction"] == pytest.approx(0.2) and m["expert_load/max_over_mean"] == 1.0
    assert not [k for k in m if k.startswith("reward/code_")]  # a rule that reports no statuses
    import dataclasses

    coded = dataclasses.replace(ro, verdicts={"passed": 3, "failed": 4, "timeout": 1})
    m = step_metrics(coded, batch, torch.ones(2, 4), parity, updates, sync, plan, Topology.single_node(3), 4.0, {})
    assert (m["reward/code_passed"], m["reward/code_failed"], m["reward/code_timeout"]) == (3 / 8, 4 / 8, 1 / 8)


def test_progress_line_shows_the_last_evaluated_accuracy_and_its_step_never_nan():
    from rlhf.tracking import Progress

    m = {"reward/mean": 0.41, "sync/bytes_received": 3_000_000, "sync/bytes_shm": 130_000,
         "parity/p99_abs_diff": 2.5e-7}
    history = [(0, 0.25), (25, 0.3984)]
    fields = progress_fields(m, history)
    assert fields == {"reward": 0.41, "acc": "0.398@25", "sync_MB": 3.13, "parity_p99": "2.5e-07"}
    assert progress_fields(m | {"route/mismatch": 0.0312}, history)["route_mismatch"] == "3.12%"
    line = Progress(30).render(27, fields, elapsed_s=54.0)  # two steps after the last evaluation
    assert "acc 0.398@25" in line and "nan" not in line
    assert "acc" not in progress_fields(m, [])  # nothing evaluated yet: no accuracy shown, not nan


def test_dp_balance_reports_the_worst_mini_batch_as_split_and_by_index():
    from rlhf.driver.metrics import dp_balance

    # two mini-batches; the second has the long samples on the even indices: by index rank 0 takes them all
    responses = [[5] * 4] * 4 + [[5] * 60, [5] * 4, [5] * 60, [5] * 4]
    batch = TokenBatch.from_samples([[1, 4]] * 8, responses).with_(attention_cost=0.01)
    m = dp_balance(batch, [[0, 1, 2, 3], [4, 5, 6, 7]], 2, 4096)
    assert m["balance/dp_cost_max_over_mean"] == pytest.approx(1.0)  # a long and a short sample on each rank
    assert m["balance/dp_cost_max_over_mean_by_index"] > 1.8
    assert dp_balance(batch, [[0, 1, 2, 3]], 1, 4096) == {}  # one DP rank: nothing to balance
