"""Engine replacement's budget and the chaos entries (the replacement itself runs end to end in
tests/e2e/test_rl_run.py)."""

from pathlib import Path

import pytest

from rlhf.config import load_run_config
from actors.remote import RoleError
from rlhf.driver.faults import policy_died, policy_restart_refusal, restart_refusal
from rlhf.errors import ConfigError
from rlhf.config.chaos import engine_kills, trainer_kills
from rlhf.schema import RolloutConfig

REPO = Path(__file__).resolve().parents[4]


def test_replacements_are_refused_beyond_max_restarts_within_the_window():
    r = RolloutConfig(max_restarts=2, restart_window_steps=10)
    assert restart_refusal([], 1, [0], "died", r) is None
    assert restart_refusal([1], 5, [1], "died", r) is None  # the second within the window
    why = restart_refusal([1, 5], 7, [0], "rollout rank 0: generate failed", r)
    assert why and "engine(s) [0] died at step 7 (rollout rank 0: generate failed)" in why
    assert "rollout.max_restarts=2" in why and "checkpoint.resume=auto" in why
    assert restart_refusal([1, 5], 11, [0], "died", r) is None  # step 1's replacement left the window
    assert restart_refusal([], 3, [0, 1, 2], "died", r)  # three at once exceed two
    assert restart_refusal([], 3, [0], "died", RolloutConfig(max_restarts=0))  # 0: a dead engine stops the run


def test_kill_entries_parse_and_bad_ones_name_what_to_write():
    assert engine_kills(("1@3", "0@5:sync", "1@8:evaluate")) == [(3, 1, "generate"), (5, 0, "sync"), (8, 1, "evaluate")]
    assert trainer_kills(("1@10", "0@4:sync")) == [(10, 1, "update"), (4, 0, "sync")]
    for bad in ("3:1", "1@x", "13", "1@3:boom"):
        with pytest.raises(ValueError, match="ENGINE@STEP" if bad != "1@3:boom" else "none of generate, sync"):
            engine_kills((bad,))


def test_a_dead_trainer_rank_restarts_from_a_checkpoint_or_stops_saying_how_to_go_on():
    cfg = load_run_config(REPO / "configs/tiny_cpu.yaml", ["trainer.max_restarts=1", "checkpoint.dir=/ck"])
    dead = RoleError("trainer", 1, "update", "failed: the actor died (killed)", died=True)
    assert policy_died(dead) and not policy_died(RoleError("trainer", 1, "update", "raised ValueError: x"))
    assert not policy_died(RoleError("rollout", 0, "generate", "failed: the actor died", died=True))  # replaced alone
    assert policy_restart_refusal(dead, Path("/ck/step_000008"), 0, cfg, []) is None
    why = policy_restart_refusal(dead, None, 0, cfg, ["Traceback (most recent call last):", "MemoryError"])
    assert why.startswith("trainer rank 1 died at update") and "set checkpoint.every_steps" in why
    assert "MemoryError" in why and "from the start" in why
    why = policy_restart_refusal(dead, Path("/ck/step_000008"), 1, cfg, [])
    assert "trainer.max_restarts=1" in why and "checkpoint.dir=/ck checkpoint.resume=auto" in why


@pytest.mark.parametrize("overrides, key", [
    (["chaos.kill_engines=[2@3]"], "engines are 0..1"),  # the tiny job has two engines
    (["chaos.kill_engines=[1@400]"], "steps 1..350"),
    (["chaos.kill_engines=[1@3:later]"], "none of generate, sync, evaluate"),
    (["rollout.max_restarts=-1"], "rollout.max_restarts = -1"),
    (["trainer.max_restarts=-1"], "trainer.max_restarts = -1"),
    (["chaos.kill_trainer_ranks=[2@3]"], "trainer ranks are 0..1"),  # dp2 x ep2: two ranks (ep within dp)
    (["chaos.kill_trainer_ranks=[1@3:generate]"], "none of update, logprobs, sync"),
    (["rollout.restart_window_steps=0"], "rollout.restart_window_steps = 0"),
    (["rollout.hang_timeout_s=-1"], "rollout.hang_timeout_s = -1"),
    (["chaos.stop_engines=[1@3:update]"], "none of generate, sync, evaluate"),
    (["rollout.liveness_probe_s=-1"], "rollout.liveness_probe_s = -1"),
    (["trainer.liveness_probe_s=-1"], "trainer.liveness_probe_s = -1"),
    (["rollout.liveness_probe_s=0.2"], "at least 1 s"),
    (["chaos.stop_trainer_ranks=[2@3]"], "trainer ranks are 0..1"),
    (["chaos.stop_trainer_ranks=[1@3:evaluate]"], "none of update, logprobs, sync"),
    (["chaos.stop_engines=[5@3]"], "engines are 0..1"),
])
def test_bad_fault_settings_are_refused_before_any_actor_starts(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_run_config(REPO / "configs/tiny_cpu.yaml", overrides)


def test_chaos_stop_signals_only_an_engine_process_on_this_machine():
    """chaos.stop_engines sends SIGSTOP from the driver: a pid that is not a local engine actor (an engine on
    another node, whose pid means nothing here) is refused before any signal, never some other process."""
    import os

    from rlhf.driver.faults import _actor_process

    for pid in (os.getpid(), 2 ** 22 + 1):  # this test's own process; a pid no process has
        with pytest.raises(ValueError, match="not a process on the driver's machine"):
            _actor_process(pid, "VLLMEngine", "rollout engine 1")
