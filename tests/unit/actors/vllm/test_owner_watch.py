"""A process vLLM starts for an engine ends when the process owning the engine is gone (actors/vllm/owner_watch.py),
with real processes: the owner killed outright, its watching children end, a child that does not watch lives."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.vllm import owner_watch

REPO = Path(__file__).resolve().parents[4]

CHILD = """
import os, signal, sys, time
from pathlib import Path
if sys.argv[1] == "ignores-sigterm":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as vLLM's engine core does, in effect, while it starts
if sys.argv[1] != "bystander":
    from actors.vllm.owner_watch import register
    register()
Path(sys.argv[2], str(os.getpid())).touch()
time.sleep(120)
"""

OWNER = """
import os, subprocess, sys, time
env = dict(os.environ, RLHF_VLLM_OWNER_PID=str(os.getpid()), RLHF_VLLM_ORPHAN_GRACE_S="1")
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[1], kind, sys.argv[2]], env=env)
        for kind in ("watches", "ignores-sigterm", "bystander")]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(120)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed owner's children are reparented; whoever reaps them may be slow)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_watching_children_end_with_their_killed_owner_and_others_live(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, CHILD, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    pids = [int(p) for p in owner.stdout.readline().split()]
    try:
        watches, ignores, bystander = pids
        assert wait_until(lambda: all((tmp_path / str(p)).exists() for p in pids), 60), "children did not start"
        assert all(running(p) for p in pids)
        owner.kill()
        owner.wait()
        assert wait_until(lambda: not running(watches), 10), "a watching child outlived its owner"
        assert wait_until(lambda: not running(ignores), 10), "a child ignoring SIGTERM stayed past its grace"
        assert running(bystander), "a child that does not watch was ended too"
    finally:
        owner.kill()
        for p in pids:
            if running(p):
                os.kill(p, signal.SIGKILL)


def test_the_owner_itself_and_a_process_without_an_owner_watch_nothing(monkeypatch):
    """An in-process engine core loads vLLM's plugins in the owner itself; a process vLLM starts for someone
    else (no owner in its environment) is not ours to end."""
    monkeypatch.setattr(owner_watch, "_watching", None)
    monkeypatch.setenv(owner_watch.OWNER_ENV, str(os.getpid()))
    owner_watch.register()
    monkeypatch.delenv(owner_watch.OWNER_ENV)
    owner_watch.register()
    assert owner_watch._watching is None


@pytest.mark.parametrize("allowed, expected", [(None, None), ("other", f"other,{owner_watch.PLUGIN}"),
                                               ("", owner_watch.PLUGIN),
                                               (owner_watch.PLUGIN, owner_watch.PLUGIN)])
def test_the_platform_names_the_owner_and_keeps_the_watch_in_a_plugin_allow_list(tmp_path, monkeypatch, allowed,
                                                                                  expected):
    from actors.vllm import platform as vllm_platform
    from rlhf.schema import DeviceType, RolloutConfig
    from tests.unit.actors.vllm.test_vllm_platform import unset_for_the_test

    monkeypatch.setattr(vllm_platform, "TEMP_BASE", str(tmp_path))
    unset_for_the_test(monkeypatch)
    if allowed is not None:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    vllm_platform.prepare_platform(DeviceType.cpu, RolloutConfig())
    assert os.environ[owner_watch.OWNER_ENV] == str(os.getpid())
    assert os.environ.get("VLLM_PLUGINS") == expected
