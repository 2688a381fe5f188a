"""The code verifier's sandbox: real `python -I` processes under limits, scored against both test forms, each
sample's process a fork of a warm interpreter (the default) or a fresh one."""

import json
import os
import time
from dataclasses import replace

import pytest

from rlhf.data.sandbox import check, check_batch, extract_program, parse_tests
from rlhf.schema import SandboxConfig, SandboxIsolation

FAST = SandboxConfig(timeout_s=3.0, memory_mb=512, max_output_kb=64, processes=2)
FRESH = SandboxConfig(timeout_s=3.0, memory_mb=512, max_output_kb=64, processes=2, fork_server=False)


@pytest.fixture(params=[FAST, FRESH], ids=["fork", "fresh"])
def cfg(request):
    return request.param
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
SUM_STDIO = json.dumps({"inputs": ["1 2\n", "10 -4\n"], "outputs": ["3\n", "6"]})


def test_the_program_is_the_last_fenced_block_or_the_whole_response():
    assert extract_program("x = 1") == "x = 1"
    text = "first\n```python\na = 1\n```\nthen\n```py\nb = 2\n```\ndone"
    assert extract_program(text) == "b = 2\n"
    assert extract_program("```\nprint(3)\n```") == "print(3)\n"


def test_tests_parse_in_both_forms_and_bad_ones_say_what_is_wrong():
    assert parse_tests(ADD_TESTS).asserts == ADD_TESTS
    assert parse_tests(SUM_STDIO).cases == (("1 2\n", "3\n"), ("10 -4\n", "6"))
    for bad, msg in (("", "empty"), ("assert (", "not valid Python"), ("{not json", "not JSON"),
                     ('{"inputs": ["1"], "outputs": []}', "as long as each other"),
                     ('{"inputs": [1], "outputs": [1]}', "lists of strings")):
        with pytest.raises(ValueError, match=msg):
            parse_tests(bad)


def test_assert_tests_pass_fail_and_break(cfg):
    assert check(f"```python\n{ADD}```", ADD_TESTS, cfg).status == "passed"
    wrong = check("def add(a, b):\n    return a - b\n", ADD_TESTS, cfg)
    assert (wrong.score, wrong.status) == (0.0, "failed") and "AssertionError" in wrong.detail
    broken = check("def add(a, b) return a", ADD_TESTS, cfg)
    assert (broken.score, broken.status) == (0.0, "error") and "SyntaxError" in broken.detail
    assert check("raise RuntimeError('no')", ADD_TESTS, cfg).status == "error"


def test_stdin_stdout_cases_compare_lines_without_trailing_whitespace(cfg):
    prog = "a, b = map(int, input().split())\nprint(a + b, '  ')\n"
    assert check(prog, SUM_STDIO, cfg).score == 1.0
    r = check("print(3)", SUM_STDIO, cfg)  # right on the first case only
    assert r.status == "failed" and r.detail.startswith("case 1")
    # sys.exit(0) is a normal end of a stdin/stdout program
    assert check("import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)", SUM_STDIO, cfg).score == 1.0


def test_a_program_that_exits_before_the_asserts_scores_zero(cfg):
    for early in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit"):
        r = check(ADD + early, "assert add(1, 1) == 3", cfg)
        assert (r.score, r.status) == (0.0, "error"), early
        assert "before the tests ran to the end" in r.detail, r.detail


def test_limits_stop_loops_memory_and_output_floods(cfg):
    t0 = time.perf_counter()
    r = check("while True:\n    pass", "assert True", replace(cfg, timeout_s=1.0, processes=1))
    assert (r.status, r.score) == ("timeout", 0.0) and time.perf_counter() - t0 < 5
    r = check("x = bytearray(2 * 1024 ** 3)", "assert len(x) > 0", cfg)
    assert r.status == "error" and "MemoryError" in r.detail
    r = check("while True:\n    print('x' * 1000)", "assert True", cfg)
    assert r.status == "error" and "KiB of output" in r.detail


def _alive(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmd and state != b"Z":
            found.append(int(pid))
    return found


def test_children_the_program_started_are_killed_with_it(cfg):
    # one child in the run's group, one that moved to a group of its own; the program itself ends at once
    prog = ("import os, subprocess\n"
            "subprocess.Popen(['sleep', '61.2345'])\n"
            "subprocess.Popen(['sleep', '61.2346'], preexec_fn=os.setpgrp)\n"
            "print(3)\n")
    assert check(prog, json.dumps({"inputs": [""], "outputs": ["3"]}), cfg).score == 1.0
    deadline = time.time() + 5
    while (_alive("61.2345") or _alive("61.2346")) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive("61.2345") and not _alive("61.2346")


def test_a_batch_keeps_order_runs_in_parallel_and_leaves_no_directory(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the runs' directories go
    responses = [ADD, "def add(a, b):\n    return 0\n", "import time\ntime.sleep(0.6)\n" + ADD, ADD]
    t0 = time.perf_counter()
    results = check_batch(responses, [ADD_TESTS, ADD_TESTS, ADD_TESTS, "not python ("], FAST)
    assert [r.score for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert results[3].status == "bad_tests"
    assert time.perf_counter() - t0 < 10
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="one answer per response"):
        check_batch(["x"], [], FAST)


def test_tests_that_check_nothing_are_refused():
    for nothing in ("405", "x = 1", "pass"):
        with pytest.raises(ValueError, match="check nothing"):
            parse_tests(nothing)
    assert parse_tests("check(add)").asserts == "check(add)"  # HumanEval's form: a call that asserts


def test_installed_packages_are_importable_only_when_asked():
    prog, tests = "import yaml\n", "assert yaml.safe_load('a: 1') == {'a': 1}"
    r = check(prog, tests, FAST)
    assert r.status == "error" and "ModuleNotFoundError" in r.detail
    assert check(prog, tests, SandboxConfig(timeout_s=5.0, site_packages=True)).score == 1.0


def test_stdin_stdout_cases_each_get_a_deadline_and_the_first_failure_stops_the_sample():
    cfg = SandboxConfig(timeout_s=1.0, memory_mb=512, processes=1)
    prog = ("import sys\nx = input()\n"
            "if x == 'loop':\n    while True: pass\n"
            "if x == 'die':\n    sys.exit('bad input')\n"
            "print(x)\n")
    cases = lambda *xs: json.dumps({"inputs": list(xs), "outputs": list(xs)})  # noqa: E731
    assert check(prog, cases(*[str(i) for i in range(40)]), cfg).score == 1.0
    t0 = time.perf_counter()
    r = check(prog, cases("a", "loop", "b"), cfg)
    assert (r.status, r.detail) == ("timeout", "run 1: over 1.0 s") and time.perf_counter() - t0 < 4
    r = check(prog, cases("a", "die", "loop"), cfg)  # stops at case 1: case 2 never runs into its deadline
    assert r.status == "error" and r.detail.startswith("run 1: exit 1") and "bad input" in r.detail


def test_a_program_that_kills_its_launcher_scores_zero_and_in_the_box_cannot(cfg):
    """A stdin/stdout case's parent is its launcher. Without the box the kill ends the sample (scored 0); in the
    box the launcher is its PID namespace's init, which its namespace's processes cannot kill: the program goes
    on, and its output is what is scored."""
    prog = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint(input())\n"
    r = check(prog, json.dumps({"inputs": ["1"], "outputs": ["1"]}), replace(cfg, isolation=SandboxIsolation.process))
    assert (r.score, r.status) == (0.0, "error")
    r = check(prog, json.dumps({"inputs": ["1"], "outputs": ["1"]}), cfg)
    assert (r.score, r.status) == (1.0, "passed")


def test_the_first_wrong_output_stops_the_cases_that_follow(tmp_path):
    # each case sleeps, then notes that it ran (outside the sandbox's directory) and prints a wrong answer
    log = tmp_path / "ran"
    prog = f"import time\ntime.sleep(0.5)\nopen({str(log)!r}, 'a').write(input() + chr(10))\nprint('wrong')\n"
    outside = replace(FAST, isolation=SandboxIsolation.process)  # the note is written outside its directory
    r = check(prog, json.dumps({"inputs": [str(i) for i in range(20)], "outputs": ["right"] * 20}), outside)
    assert r.status == "failed" and r.detail.startswith("case 0")
    time.sleep(0.7)  # a later case, had it been left running, would have written by now
    assert log.read_text() == "0\n"


def _servers() -> list[int]:
    """This process's fork servers still running."""
    from rlhf.data.sandbox_exec import _every
    return [s.proc.pid for s in _every if s.proc.poll() is None]


def test_forked_samples_do_not_see_each_other_and_a_server_a_program_killed_is_replaced():
    from rlhf.data import sandbox_exec

    one = SandboxConfig(timeout_s=3.0, memory_mb=512, processes=1)
    leak = "import builtins, sys\nbuiltins.leaked = 1\nsys.modules['json'] = None\n"
    assert check(leak, "assert builtins.leaked == 1", one).score == 1.0
    # the next fork of the same server sees none of it
    assert check("import json\n", "assert json.loads('1') == 1\nassert not hasattr(__builtins__, 'leaked')",
                 one).score == 1.0
    # in the box a program cannot see its server: it is its PID namespace's init (its parent pid reads 0), alone in
    # its group, and an init ignores a kill from inside its namespace: the program goes on, the server lives on
    servers = _servers()
    r = check("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + ADD, ADD_TESTS, one)
    assert (r.score, r.status) == (1.0, "passed")
    assert check(ADD, ADD_TESTS, one).score == 1.0
    assert _servers() == servers
    # without the box an assert-style program's parent is its server: killing it fails the sample, and the next one
    # gets a new server
    one = replace(one, isolation=SandboxIsolation.process)
    assert check(ADD, ADD_TESTS, one).score == 1.0
    servers = _servers()
    r = check("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + ADD, ADD_TESTS, one)
    assert (r.score, r.status) == (0.0, "error")
    assert check(ADD, ADD_TESTS, one).score == 1.0
    assert _servers() != servers
    sandbox_exec.close_all()
    assert _servers() == [] and sandbox_exec._every == []


def test_a_server_whose_worker_went_away_kills_its_run_and_exits(tmp_path):
    from rlhf.data.sandbox_exec import ForkServer

    server = ForkServer(("-I", "-S"), {"PATH": os.environ["PATH"]})
    # the program sleeps, and so does a child of it that moved to a group of its own
    (tmp_path / "main.py").write_text("import os, subprocess, time\n"
                                      "subprocess.Popen(['sleep', '60.4322'], preexec_fn=os.setpgrp)\n"
                                      "time.sleep(60.4321)\n")
    r, w = os.pipe()
    os.write(w, b"nonce")
    os.close(w)
    progress = os.pipe()
    with open(os.devnull, "rb") as fin, open(tmp_path / "out", "wb") as fout:
        pid = server.start(str(tmp_path), 60.0, [str(512 << 20), "5", "65536", "R", "1", "P", "asserts", "5", "1",
                                                   "py"],
                           [fin.fileno(), fout.fileno(), fout.fileno(), r, progress[1]])
    for fd in (r, *progress):
        os.close(fd)
    time.sleep(0.3)
    assert os.path.exists(f"/proc/{pid}") and _alive("60.4322")
    server.sock.close()  # the worker's end goes away, as when the reward worker is killed
    deadline = time.time() + 5
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}")
    assert server.proc.wait(timeout=5) == 0
    assert not _alive("60.4322")


def test_partial_credit_scores_the_share_of_cases_passed_and_runs_them_all(cfg):
    partial = replace(cfg, partial_credit=True, timeout_s=1.0)
    tests = json.dumps({"inputs": ["1", "2", "loop", "4", "die"], "outputs": ["1", "2", "3", "4", "5"]})
    prog = ("import sys\nx = input()\n"
            "if x == 'loop':\n    while True: pass\n"
            "if x == 'die':\n    sys.exit('bad input')\n"
            "print(x)\n")
    r = check(prog, tests, partial)  # cases 0, 1 and 3 pass; 2 times out, 4 exits 1
    assert (r.score, r.status) == (3 / 5, "timeout") and r.detail == "run 2: over 1.0 s"
    assert check(prog, tests, replace(partial, partial_credit=False)).score == 0.0  # all or nothing
    assert check("print(input())", json.dumps({"inputs": ["a", "b"], "outputs": ["a", "b"]}), partial).score == 1.0
    assert check("print(", tests, partial).score == 0.0  # does not compile: no case passes
    # assert-style tasks stay all or nothing
    assert check("def add(a, b):\n    return 3\n", ADD_TESTS, partial).score == 0.0
