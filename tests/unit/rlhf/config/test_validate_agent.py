"""`agent.*`: a run of episodes is refused before anything starts when its environment cannot be made, its
limits leave no room for a turn, or it asks for what episodes do not support yet, each problem by its key."""

import pytest

from rlhf.config import ConfigError, load_run_config

ENV = "agent.environment=rlhf.agents.retry:Retry"


def _load(tmp_path, *overrides):
    (tmp_path / "run.yaml").write_text("{}")
    return load_run_config(tmp_path / "run.yaml", list(overrides))


def test_an_episode_run_loads_with_its_environment_arguments(tmp_path):
    cfg = _load(tmp_path, ENV, "agent.environment_args={feedback: ' no', decay: 0.5}", "data.max_prompt_tokens=16",
                "model.max_position_embeddings=128", "agent.max_tokens=64", "rollout.block_size=32")
    assert cfg.agent.enabled and cfg.agent.environment_args == {"feedback": " no", "decay": 0.5}
    assert cfg.rollout.block_size == 32 and not _load(tmp_path).agent.enabled


def test_each_problem_of_an_episode_run_is_named(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, "agent.environment=rlhf.agents.retry:Retry", "agent.environment_args={decay: 2}",
              "agent.max_turns=0", "agent.max_tokens=8000", "agent.step_timeout_s=0", "stale_sync.max_staleness=1",
              "algorithm.tis_cap=2", "algorithm.dynamic_sampling=true", "rollout.capture_routes=true",
              "rollout.block_size=48")
    msg = str(e.value)
    assert "stale_sync.max_staleness = 1: is not supported" not in msg  # episodes run under StaleSync
    assert "rollout.capture_routes" not in msg  # and keep their routes
    for line in ("agent.max_turns = 0: must be >= 1",
                 "agent.max_tokens = 8000: exceeds the model's context",
                 "agent.step_timeout_s = 0", "fix agent.environment_args",
                 "algorithm.dynamic_sampling = True: is not",
                 "rollout.block_size = 48: must be a multiple of 32"):
        assert line in msg, (line, msg)


def test_an_episode_run_takes_routing_replay(tmp_path):
    cfg = _load(tmp_path, ENV, "trainer.routing_replay=rollout", "agent.max_tokens=96")
    assert cfg.agent.enabled and cfg.captures_routes


def test_an_episode_run_takes_stalesync_and_partial_rollouts(tmp_path):
    cfg = _load(tmp_path, ENV, "stale_sync.max_staleness=1", "stale_sync.partial_rollout=true", "algorithm.tis_cap=2",
                "rollout.sleep_level=0", "agent.max_tokens=96")
    assert cfg.agent.enabled and cfg.stale_sync.max_staleness == 1 and cfg.stale_sync.partial_rollout


@pytest.mark.parametrize("spec,why", [("retry", "give 'module:Class'"), ("no_such_pkg:Env", "does not import"),
                                      ("rlhf.agents.retry:Nope", "has no class 'Nope'")])
def test_an_environment_that_cannot_be_made_is_refused_before_anything_starts(tmp_path, spec, why):
    with pytest.raises(ConfigError, match=why):
        _load(tmp_path, f"agent.environment={spec}")


def test_an_episode_run_has_environment_workers_and_no_reward_workers(tmp_path):
    """The environments reward the episodes: the run places `agent.workers` environment workers (as rule
    verifiers are placed) and no reward workers, and `rlhf plan` lists them."""
    from pathlib import Path

    from rlhf.placement import device_map
    from rlhf.report.plan import plan_report

    cfg = load_run_config(Path(__file__).resolve().parents[4] / "configs" / "tiny_cpu_retry.yaml", ["agent.workers=2"])
    dm = device_map(cfg)
    assert dm.role_names == ("trainer", "rollout", "environment") and dm.devices_of("environment") == (0, 1)
    lines, summary = plan_report(cfg, dm)
    assert summary["roles"] == {"trainer": 2, "rollout": 2, "environment": 2}
    assert any("environment 2 workers (rlhf.agents.retry:Retry): devices 0-1" in line for line in lines)
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, ENV, "agent.workers=0", "chaos.kill_environment_workers=[x@1]")
    assert "agent.workers = 0: must be >= 1" in str(e.value) and "WORKER@STEP" in str(e.value)
    with pytest.raises(ConfigError, match="which only agent runs"):
        _load(tmp_path, "chaos.kill_environment_workers=[0@1]")
