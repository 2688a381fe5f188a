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
    for line in ("agent.max_turns = 0: must be >= 1",
                 "agent.max_tokens = 8000: exceeds the model's context",
                 "agent.step_timeout_s = 0", "fix agent.environment_args",
                 "stale_sync.max_staleness = 1: is not supported with agent.environment",
                 "rollout.capture_routes = True: is not supported", "algorithm.dynamic_sampling = True: is not",
                 "rollout.block_size = 48: must be a multiple of 32"):
        assert line in msg, (line, msg)


@pytest.mark.parametrize("spec,why", [("retry", "give 'module:Class'"), ("no_such_pkg:Env", "does not import"),
                                      ("rlhf.agents.retry:Nope", "has no class 'Nope'")])
def test_an_environment_that_cannot_be_made_is_refused_before_anything_starts(tmp_path, spec, why):
    with pytest.raises(ConfigError, match=why):
        _load(tmp_path, f"agent.environment={spec}")
