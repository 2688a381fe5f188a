"""C++ programs in the code verifier: a response whose last fenced block is tagged cpp (c++, cxx, cc) is compiled
(`reward.sandbox.cpp_command`, under limits and its own wall clock) and its binary runs each stdin/stdout case
under the same limits as a Python program, from a fork of a warm interpreter or a fresh one. Real g++ compiles."""

import json
import os
import tempfile
import time
from dataclasses import replace

import pytest

from rlhf.data.sandbox import check, extract
from tests.unit.rlhf.data.test_sandbox import FAST, FRESH, _alive

SUM = json.dumps({"inputs": ["1 2\n", "40 2\n", "5 5\n"], "outputs": ["3\n", "42\n", "10"]})
ADD = '#include <cstdio>\nint main() { long long a, b; scanf("%lld %lld", &a, &b); printf("%lld\\n", a + b); }\n'


def cpp(source: str, tag: str = "cpp") -> str:
    return f"Here it is:\n```{tag}\n{source}```\n"


@pytest.fixture(params=[FAST, FRESH], ids=["fork", "fresh"])
def cfg(request):
    return request.param


def test_the_language_is_the_last_fenced_blocks_tag():
    assert extract(cpp("int main() {}\n")) == ("cpp", "int main() {}\n")
    assert [extract(cpp("x", tag))[0] for tag in ("c++", "CXX", "cc", "python", "py", "")] == \
        ["cpp", "cpp", "cpp", "python", "python", "python"]
    assert extract("```cpp\nint main() {}\n```\nor in Python:\n```python\nprint(1)\n```") == ("python", "print(1)\n")
    assert extract("print(1)") == ("python", "print(1)")  # no fence: the whole response, as Python


def test_a_cpp_program_is_compiled_once_and_runs_every_case(cfg):
    before = {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("cc")}  # g++'s temporary files
    r = check(cpp(ADD), SUM, cfg)
    assert (r.score, r.status) == (1.0, "passed"), r.detail
    wrong = check(cpp(ADD.replace("a + b", "a * b"), "c++"), SUM, cfg)
    assert (wrong.score, wrong.status) == (0.0, "failed") and wrong.detail == "case 0: expected '3\\n', got '2\\n'"
    # partial credit: the share of the cases passed (40 * 2 is not 42; 1 * 2 is not 3; 5 + 5 is 10 both ways)
    half = ADD.replace("a + b", "a == 5 ? a + b : a * b")
    assert check(cpp(half), SUM, replace(cfg, partial_credit=True)).score == pytest.approx(1 / 3)
    assert {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("cc")} <= before


def test_compile_errors_crashes_loops_and_memory_blowups_score_zero(cfg):
    short = replace(cfg, timeout_s=1.0)
    r = check(cpp("int main( { return 0; }\n"), SUM, short)
    assert r.status == "error" and r.detail.startswith("run 0: the compile failed (exit 1): main.cpp:"), r.detail
    r = check(cpp("int main() { volatile int *p = nullptr; *p = 1; }\n"), SUM, short)
    assert (r.status, r.detail) == ("error", "run 0: exit -11: ")  # SIGSEGV
    r = check(cpp("int main() { volatile long x = 0; while (true) x++; }\n"), SUM, short)
    assert (r.status, r.detail) == ("timeout", "run 0: over 1.0 s")
    huge = "#include <vector>\nint main() { std::vector<char> v(4000000000ULL, 1); return v[7] - 1; }\n"
    r = check(cpp(huge), SUM, short)  # over memory_mb: the allocation fails
    assert r.status == "error" and "bad_alloc" in r.detail, r.detail


def test_a_compile_past_its_timeout_is_killed_with_what_it_started():
    # a compiler that hangs (nothing to precompile with it)
    slow = replace(FAST, cpp_command="sh -c 'sleep 61.4567' --", compile_timeout_s=1.0, cpp_precompiled_header="")
    t0 = time.monotonic()
    r = check(cpp(ADD), SUM, slow)
    assert (r.status, r.detail) == ("timeout", "run 0: the compile took over 1.0 s") and time.monotonic() - t0 < 5
    deadline = time.time() + 5
    while _alive("61.4567") and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive("61.4567")


def test_a_missing_compiler_or_a_cpp_program_for_python_tests_say_what_is_wrong():
    r = check(cpp(ADD), SUM, replace(FAST, cpp_command="no-such-cxx -O2"))
    assert r.status == "error" and "'no-such-cxx' is not installed" in r.detail
    assert "reward.sandbox.cpp_command" in r.detail
    r = check(cpp(ADD), "assert add(2, 3) == 5", FAST)
    assert (r.score, r.status) == (0.0, "error") and "the task wants Python" in r.detail


CONTEST = ("#include <bits/stdc++.h>\nusing namespace std;\n"
           "int main() { long long a, b; cin >> a >> b; cout << a + b << endl; }\n")


def test_bits_stdcpp_is_precompiled_once_and_taken_in_place_of_the_header(tmp_path):
    from rlhf.data.sandbox_cpp import compile_program, precompiled

    command, env = ["g++", "-O2", "-std=c++17"], {"PATH": os.environ["PATH"]}
    d = precompiled(command, "bits/stdc++.h", env, 1 << 30)
    assert d is not None and os.path.isfile(os.path.join(d, "bits", "stdc++.h.gch"))
    assert os.path.basename(d).startswith(f"rlhf-pch-{os.getpid()}-")
    assert precompiled(command, "bits/stdc++.h", env, 1 << 30) == d  # built once per process and command
    (tmp_path / "main.cpp").write_text(CONTEST)
    log = tmp_path / "compile.log"
    assert compile_program([*command, "-H", "-I", d, "-o", "main", "main.cpp"], str(tmp_path), env, 1 << 30, 30.0,
                           str(log)) == 0
    assert f"! {d}/bits/stdc++.h.gch" in log.read_text()  # g++ -H: "!" marks a precompiled header it used
    assert check(cpp(CONTEST), SUM, FAST).status == "passed"  # what a reward worker does, with the default config


def test_release_stops_the_interpreters_and_removes_every_directory_and_the_next_program_remakes_them():
    """What a reward worker does before it is killed (a killed Ray actor runs no exit handler)."""
    from rlhf.data import sandbox_exec
    from rlhf.data.sandbox import release
    from rlhf.data.sandbox_box import ROOT_PREFIX, WORK_PREFIX, box_problem
    from rlhf.data.sandbox_cpp import PCH_PREFIX

    def mine() -> list[str]:
        return sorted(n for n in os.listdir(tempfile.gettempdir())
                      if any(n.startswith(f"{p}{os.getpid()}-") for p in (PCH_PREFIX, ROOT_PREFIX, WORK_PREFIX)))

    py = json.dumps({"inputs": ["2 3\n"], "outputs": ["5"]})
    assert check(cpp(ADD), SUM, FAST).status == "passed"  # a precompiled header, and a box where the kernel has one
    assert check("print(sum(map(int, input().split())))", py, FAST).status == "passed"  # a warm interpreter
    servers = [s.proc.pid for s in sandbox_exec._every]
    boxed = box_problem() is None
    made = mine()
    assert any(n.startswith(PCH_PREFIX) for n in made) and servers
    assert any(n.startswith(WORK_PREFIX) for n in made) == boxed
    release()
    assert mine() == [] and sandbox_exec._every == []
    deadline = time.time() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in servers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in servers)
    assert check("print(sum(map(int, input().split())))", py, FAST).status == "passed"
    assert any(n.startswith(WORK_PREFIX) for n in mine()) == boxed
    release()
    assert mine() == []


def test_a_workers_threads_asking_at_once_make_one_scratch_directory():
    """The driver's held-out evaluation and a reward worker check programs on several threads: each box's
    directories made once per process, so `release` removes every one."""
    import threading

    from rlhf.data import sandbox_box

    sandbox_box.release()
    barrier, got = threading.Barrier(8), []

    def ask():
        barrier.wait()
        got.append(sandbox_box.scratch())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mine = [n for n in os.listdir(tempfile.gettempdir())
            if n.startswith((f"{sandbox_box.ROOT_PREFIX}{os.getpid()}-", f"{sandbox_box.WORK_PREFIX}{os.getpid()}-"))]
    assert len(set(got)) == 1 and len(mine) == 2
    sandbox_box.release()
    assert not any(os.path.exists(p) for p in got[0])


def test_a_header_that_cannot_be_precompiled_leaves_compiles_as_they_were(caplog):
    from rlhf.data.sandbox_cpp import precompiled

    assert precompiled(["g++", "-O2"], "no/such_header.h", {"PATH": os.environ["PATH"]}, 1 << 30) is None
    assert "<no/such_header.h> could not be precompiled" in caplog.text
    assert check(cpp(ADD), SUM, replace(FAST, cpp_precompiled_header="no/such_header.h")).status == "passed"


def test_the_directories_of_dead_processes_go_and_live_ones_stay():
    from rlhf.data.sandbox_cpp import PCH_PREFIX, remove_dead_dirs

    dead = tempfile.mkdtemp(prefix=f"{PCH_PREFIX}{2**22 + 12345}-")  # above the kernel's pid limit: never alive
    live = tempfile.mkdtemp(prefix=f"{PCH_PREFIX}{os.getpid()}-")
    try:
        assert os.path.basename(dead) in remove_dead_dirs() and not os.path.exists(dead)
        assert os.path.isdir(live)
    finally:
        os.rmdir(live)
