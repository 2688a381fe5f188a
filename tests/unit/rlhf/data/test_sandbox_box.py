"""The code verifier's box (`reward.sandbox.isolation: kernel`): a battery of hostile programs, in Python and C++
(rlhf/data/sandbox_hostile.py), each built to pass its test if its attack works. In the box every one scores 0,
nothing it started outlives it, nothing it wrote lands outside its directory, no connection reaches the
listener, and the worker and its fork servers go on. A few run without the box too (`isolation: process`), where
they succeed: the battery can fail. Traffic goes to loopback only."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf.data.sandbox import check, check_batch
from rlhf.data.sandbox_box import box_problem, isolation_problem, seccomp_filter
from rlhf.data.sandbox_hostile import Setup, attacks, left_behind, response
from rlhf.schema import SandboxConfig, SandboxIsolation

pytestmark = pytest.mark.skipif(box_problem() is not None, reason=f"no box on this machine: {box_problem()}")

BOXED = SandboxConfig(timeout_s=5.0, memory_mb=1024, max_output_kb=256, processes=2)
UNBOXED = replace(BOXED, isolation=SandboxIsolation.process)
# attacks that succeed without the box and leave nothing behind there (the others would write or kill outside it)
CONTRAST = ("read the Ray token", "read the run's weights", "read another process's environment",
            "connect to a loopback listener", "make a namespace")


class Listener:
    """A TCP listener on 127.0.0.1 counting the connections it accepts."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.sock.getsockname()[1], 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self):
        self.sock.close()


@pytest.fixture
def setup(tmp_path):
    marker = uuid.uuid4().hex[:8]
    home = Path.home() / f".rlhf-box-test-{marker}"  # a file in the real home directory, removed after
    files = {"ray_token": (tmp_path / "ray" / "auth_token", "token-" + marker),
             "weights": (tmp_path / "out" / "model.safetensors", "weights-" + marker),
             "home": (home, "home-" + marker)}
    for path, text in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    holder = subprocess.Popen(["sleep", "300"], env={"PATH": os.environ["PATH"], "RLHF_BOX_TEST_SECRET": "env-" + marker})
    listener = Listener()
    try:
        yield Setup({k: (str(p), t) for k, (p, t) in files.items()}, holder.pid, "env-" + marker, listener.port,
                    os.getpid(), marker), listener
    finally:
        listener.close()
        holder.kill()
        holder.wait()
        home.unlink(missing_ok=True)


def _servers() -> list[int]:
    from rlhf.data import sandbox_exec

    return sorted(s.proc.pid for s in sandbox_exec._every)


def test_every_attack_fails_in_the_box_and_nothing_of_it_outlives_the_sample(setup):
    s, listener = setup
    battery = [a for a in attacks(s) if a.language == "python" or shutil.which("g++")]
    results = check_batch([response(a) for a in battery], [a.tests for a in battery], BOXED)
    passed = [(a.name, r.detail) for a, r in zip(battery, results) if r.score != 0.0 and not a.leaves_processes]
    assert not passed, f"attacks that worked in the box: {passed}"
    status = {a.name: r.status for a, r in zip(battery, results)}
    # a forbidden system call is `blocked`: the box killed the program (SIGSYS)
    for name in ("connect to a loopback listener", "ptrace a process", "make a namespace", "mount over its view"):
        assert status[name] == "blocked", (name, status[name])
    if shutil.which("g++"):
        assert status["connect to a loopback listener (C++)"] == "blocked"
    time.sleep(0.2)
    assert listener.accepted == 0
    deadline = time.time() + 5
    while left_behind(s.marker) and time.time() < deadline:
        time.sleep(0.05)
    assert left_behind(s.marker) == [], "processes the attacks started outlived them"
    assert not Path(f"/tmp/escaped-{s.marker}").exists() and not Path("/usr/escaped").exists()
    # the worker (this process) and its fork servers went on: a right program still passes
    servers = _servers()
    assert check("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5", BOXED).score == 1.0
    assert _servers() == servers


def test_the_same_attacks_work_without_the_box(setup):
    """The battery can fail: without the box these attacks get what they came for."""
    s, listener = setup
    battery = [a for a in attacks(s) if a.name in CONTRAST]
    results = check_batch([response(a) for a in battery], [a.tests for a in battery], UNBOXED)
    assert [(a.name, r.score) for a, r in zip(battery, results)] == [(a.name, 1.0) for a in battery]
    assert listener.accepted == 1


def test_the_box_costs_the_fresh_interpreter_path_too(setup):
    """`fork_server: false` boxes each fresh interpreter itself: the same attacks fail."""
    s, listener = setup
    fresh = replace(BOXED, fork_server=False)
    battery = [a for a in attacks(s) if a.name in CONTRAST]
    results = check_batch([response(a) for a in battery], [a.tests for a in battery], fresh)
    assert all(r.score == 0.0 for r in results) and listener.accepted == 0


def test_a_machine_without_the_box_is_refused_saying_what_to_set(monkeypatch):
    from rlhf.data import sandbox_box

    monkeypatch.setattr(sandbox_box, "box_problem", lambda: "user namespaces are off")
    msg = isolation_problem(BOXED)
    assert "reward.sandbox.isolation=kernel: user namespaces are off" in msg
    assert "reward.sandbox.isolation=process" in msg
    assert isolation_problem(UNBOXED) is None
    r = check("print(1)", '{"inputs": [""], "outputs": ["1"]}', BOXED)  # never run outside the promised box
    assert (r.score, r.status) == (0.0, "error") and "user namespaces are off" in r.detail


def test_the_filter_jumps_forward_and_ends_in_returns():
    prog = seccomp_filter()
    ret = 0x06
    assert prog[-1][0] == ret and len(prog) < 256
    for i, (code, jt, jf, _) in enumerate(prog):
        if code & 0x07 == 0x05:  # a jump: both targets inside the program
            assert i + 1 + max(jt, jf) < len(prog)


def test_the_box_directories_of_a_killed_worker_are_removed_by_the_next(tmp_path, monkeypatch):
    import tempfile

    from rlhf.data.sandbox_box import ROOT_PREFIX, WORK_PREFIX, remove_dead_dirs

    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = [tmp_path / f"{ROOT_PREFIX}{gone.pid}-x", tmp_path / f"{WORK_PREFIX}{gone.pid}-y"]
    mine = tmp_path / f"{WORK_PREFIX}{os.getpid()}-z"
    for d in dead + [mine]:
        (d / "sample").mkdir(parents=True)
    dead[1].chmod(0o311)  # kept unlistable, as a worker keeps its scratch
    assert sorted(remove_dead_dirs()) == sorted(d.name for d in dead)
    assert not any(d.exists() for d in dead) and mine.exists()
