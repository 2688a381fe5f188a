"""The code verifier (`reward.kind: code`): run the program a response wrote against the task's tests.

A task's reference answer holds its tests, in one of two forms:

    assert-style   Python run after the program, e.g. `assert add(2, 3) == 5` (LeetCode / HumanEval style)
    stdin/stdout   JSON `{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}` (APPS / CodeContests style):
                   the program reads each input on stdin; its stdout must equal the output, compared line by
                   line with trailing whitespace ignored

The program is the last fenced code block of the response (```python ... ``` or ``` ... ```), or the whole response
when it has none. A block tagged ```cpp (c++, cxx, cc) is a C++ program, for stdin/stdout tests: compiled under
limits, then its binary runs each case as a Python program would (rlhf/data/sandbox_cpp.py). A response scores 1.0
when every test passes, else 0.0 (sparse, as DeepCoder and verl's code rewards score); it never raises: a syntax
error, an exception, a wrong output, a timeout or a memory blow-up all score 0 (`SandboxResult.status` says which).

Each sample runs in a `python -I -S` process (no site-packages, no user site, no PYTHON* variables; with
`site_packages` the worker's installed packages are importable): a fork of a warm one (`fork_server`, the
default: rlhf/data/sandbox_exec.py) or a fresh one; stdin/stdout cases each in a fork of it; in its own
temporary directory (cwd and HOME, removed afterwards) and its own session, under resource limits: address
space (`memory_mb`), CPU seconds and a wall-clock `timeout_s` per run, file size, no core files; stdout and
stderr capped at `max_output_kb`. At the end, passed or killed, its process group and every process left in
its session are killed, so a program that started children leaves none behind.

With `isolation: kernel` (the default) every program and its compile run in a box (rlhf/data/sandbox_box.py):
no network, only its own directory writable, nothing of the machine readable but the interpreter, the compiler
and their libraries, its own PID namespace, a seccomp filter. A program the box stops (a system call it may not
make) scores 0 with status `blocked`. `isolation: process` is the limits alone, not a security boundary
(docs/security.md).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import secrets
import select
import shlex
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rlhf.data import sandbox_box, sandbox_cpp, sandbox_exec
from rlhf.data.sandbox_box import BLOCKED_SIGNAL, Box, isolation_problem
from rlhf.data.sandbox_cpp import compile_program, precompiled
from rlhf.data.sandbox_exec import Run
from rlhf.schema import SandboxConfig, SandboxIsolation

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


CPP_TAGS = frozenset({"cpp", "c++", "cxx", "cc"})


def release() -> None:
    """What this process's programs ran with, let go now: the warm interpreters stopped, the precompiled headers
    and the box's directories removed (all remade by the next program). A worker calls it before it is killed,
    since a Ray actor killed does not run its exit handlers; a worker killed without it leaves its directories to
    the next worker on the machine (`rlhf.leftovers`)."""
    sandbox_exec.close_all()
    sandbox_cpp.release()
    sandbox_box.release()


def extract_program(response: str) -> str:
    """The last fenced code block's body (```python ... ```, ```py, or a bare ```), else the whole response."""
    return extract(response)[1]


def extract(response: str) -> tuple[str, str]:
    """The program's language ("cpp" when the last fenced block is tagged cpp, c++, cxx or cc; else "python")
    and its source (`extract_program`)."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return "python", response
    tag, body = blocks[-1]
    return ("cpp" if tag.lower() in CPP_TAGS else "python"), body


@dataclass(frozen=True)
class Tests:
    asserts: str | None = None  # Python run after the program
    cases: tuple[tuple[str, str], ...] = ()  # (stdin, expected stdout)


@functools.lru_cache(maxsize=4096)  # a group's samples share their answer; each is scored every step it is drawn
def parse_tests(answer: str) -> Tests:
    """A task's tests from its reference answer; ValueError saying what is wrong when neither form parses."""
    text = answer.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"the answer starts with '{{' but is not JSON ({e}); stdin/stdout tests are "
                             '{"inputs": [...], "outputs": [...]}') from None
        obj = obj if isinstance(obj, dict) else {}
        ins, outs = obj.get("inputs"), obj.get("outputs")
        if not (isinstance(ins, list) and isinstance(outs, list) and ins and len(ins) == len(outs)
                and all(isinstance(s, str) for s in ins + outs)):
            raise ValueError('stdin/stdout tests need "inputs" and "outputs": lists of strings, as long as each '
                             "other, at least one")
        return Tests(cases=tuple(zip(ins, outs)))
    if not text:
        raise ValueError("the answer is empty: give assert statements or stdin/stdout tests as JSON")
    try:
        tree = ast.parse(text, "<tests>")
    except SyntaxError as e:
        raise ValueError(f"the tests are not valid Python (line {e.lineno}: {e.msg})") from None
    if not any(isinstance(n, (ast.Assert, ast.Raise, ast.Call)) for n in ast.walk(tree)):
        # e.g. an arithmetic answer such as `405`: valid Python that every program would pass
        raise ValueError("the tests check nothing (no assert, raise or call); write assert statements, or "
                         'stdin/stdout tests as JSON {"inputs": [...], "outputs": [...]}')
    return Tests(asserts=text)


@dataclass(frozen=True)
class SandboxResult:
    score: float
    status: str  # passed | failed | error | timeout | blocked (the box stopped it) | bad_tests
    seconds: float
    detail: str = ""  # the failing case, or the tail of stderr
    output: str = ""  # what the program wrote to stdout in the failing case (its first 200 characters)


@dataclass(frozen=True)
class CaseRun:
    # ok | timeout | output | early_exit | error (the launcher itself failed) | compile_error | compile_timeout |
    # blocked (the box killed it: a system call it may not make)
    status: str
    code: int | None  # the exit code
    out: str
    err: str  # its tail


def run_program(source: str, inputs: Sequence[str] | None, cfg: SandboxConfig,
                wants: Sequence[str] | None = None, every_case: bool = False, language: str = "python") -> list[CaseRun]:
    """Run `source` once (assert-style: `inputs` None) or once per input (stdin/stdout), up to the first case
    that does not exit 0 or, given `wants`, whose output is not its want (`every_case`: all of them); one
    `CaseRun` per case run. `language` "cpp" (stdin/stdout only): compiled first (`cfg.cpp_command`), each case
    runs the binary; a compile that fails or overruns is the one run returned.

    Every stdin, stdout and stderr is a file in the run's directory: output is capped by the file-size limit (a
    write past it fails), never read into the worker's memory unbounded."""
    cap = cfg.max_output_kb * 1024
    stdio = inputs is not None
    n = len(inputs) if stdio else 1
    box = None
    if cfg.isolation is SandboxIsolation.kernel:
        problem = isolation_problem(cfg)
        if problem is not None:  # never run an untrusted program outside the box it was promised
            return [CaseRun("error", None, "", problem)]
        box = Box.for_worker(cfg.site_packages)
    with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-", dir=box.scratch if box else None) as d:
        def path(name: str) -> str:
            return os.path.join(d, name)

        def tail(name: str) -> str:
            if not os.path.exists(path(name)):
                return ""
            with open(path(name), "rb") as f:
                f.seek(max(0, os.path.getsize(path(name)) - 2000))
                return f.read().decode("utf-8", "replace")

        def case(i: int, status: str, code: int | None) -> CaseRun:
            if status == "ok" and code != 0 and max(os.path.getsize(path(x)) if os.path.exists(path(x)) else 0
                                                    for x in (f"out_{i}", f"err_{i}")) >= cap:
                status = "output"  # the file-size limit stopped it (Python ignores SIGXFSZ: a write fails)
            out = b""
            if os.path.exists(path(f"out_{i}")):
                with open(path(f"out_{i}"), "rb") as f:
                    out = f.read(cap)
            return CaseRun(status, code, out.decode("utf-8", "replace"), tail(f"err_{i}"))

        for i, text in enumerate(inputs if stdio else [""]):
            Path(path(f"in_{i}")).write_text(text, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        binary = language == "cpp"
        if binary:
            if not stdio:
                raise ValueError("a C++ program needs stdin/stdout tests (assert-style tests are Python)")
            Path(path("main.cpp")).write_text(source, encoding="utf-8")
            command = shlex.split(cfg.cpp_command)
            if shutil.which(command[0], path=env["PATH"]) is None:
                return [CaseRun("error", None, "", f"the C++ compiler {command[0]!r} is not installed on this reward "
                                                   "worker's machine: install it or set reward.sandbox.cpp_command")]
            pch = precompiled(command, cfg.cpp_precompiled_header, env, cfg.memory_mb * 1024 * 1024)
            cbox = Box.for_worker(cfg.site_packages, (pch,)) if box and pch else box
            code = compile_program([*command, *(["-I", pch] if pch else []), "-o", "main", "main.cpp"], d, env,
                                   cfg.memory_mb * 1024 * 1024, cfg.compile_timeout_s, path("compile.log"), cbox)
            if code != 0:
                status = ("compile_timeout" if code is None else "blocked" if code in _BLOCKED_CODES else
                          "compile_error")
                return [CaseRun(status, code, "", tail("compile.log"))]
        else:
            Path(path("main.py")).write_text(source, encoding="utf-8")
        nonce = secrets.token_hex(16).encode()
        r, w = os.pipe()
        os.write(w, nonce)
        os.close(w)
        pr, pw = os.pipe()  # the launcher's progress (stdin/stdout)
        args = [str(cfg.memory_mb * 1024 * 1024), str(int(cfg.timeout_s) + 1), str(cap), "R", str(n), "P",
                "stdio" if stdio else "asserts", str(cfg.timeout_s), "0" if every_case else "1", "bin" if binary else "py"]
        # assert-style: the launcher is the program (case 0's files); stdin/stdout: the launcher's own log
        names = ("launcher.log", "launcher.log") if stdio else ("out_0", "err_0")
        runs: list[CaseRun] = []
        end = b""
        deadline = cfg.timeout_s * n + 1.0
        try:
            with open(path("in_0") if not stdio else os.devnull, "rb") as fin, open(path(names[0]), "wb") as fout, \
                    open(path(names[1]), "ab") as ferr:
                try:
                    run = Run(("-I",) if cfg.site_packages else ("-I", "-S"), env, d,
                              [fin.fileno(), fout.fileno(), ferr.fileno(), r, pw], args, deadline + 5.0, cfg.fork_server,
                              box)
                finally:
                    os.close(r)
                    os.close(pw)
                try:
                    if stdio:
                        end = _follow(pr, time.monotonic() + deadline, runs, case, wants, stop=not every_case)
                    else:
                        run.wait(cfg.timeout_s)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    returncode = run.finish()
        finally:
            os.close(pr)
        if not stdio:
            if timed_out:
                return [case(0, "timeout", None)]
            done = Path(path("done")).read_bytes() if os.path.exists(path("done")) else b""
            return [case(0, "early_exit" if returncode == 0 and done != nonce else "ok", returncode)]
        if not every_case and runs and not _passed(runs[-1], None if wants is None else wants[len(runs) - 1]):
            return runs  # stopped at a case that failed: the verdict is in its run
        if end != nonce:  # the launcher did not get through: killed at the deadline, or broke itself
            return runs + [CaseRun("timeout" if timed_out else "error", returncode, "", tail("launcher.log"))]
        return runs


def _follow(pr: int, deadline: float, runs: list, case, wants, stop: bool = True) -> bytes:
    """Read the launcher's progress until its end line (returns the nonce in it) or the pipe closes (b""):
    each finished case becomes a run, compared with its want at once; a wrong one ends the wait early (unless
    not `stop`). TimeoutExpired past the deadline."""
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            what, _, value = line.partition(b" ")
            if what == b"end":
                return value
            i = int(what)
            runs.append(case(i, "ok" if value != b"-" else "timeout", None if value == b"-" else int(value)))
            if stop and not _passed(runs[-1], None if wants is None else wants[i]):
                return b""
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([pr], [], [], left)[0]:
            raise subprocess.TimeoutExpired("sandbox", deadline)
        chunk = os.read(pr, 4096)
        if not chunk:
            return b""
        buf += chunk


# exit codes of a program the box killed (SIGSYS): as a case's status, or the boxed process's 128 + signal
_BLOCKED_CODES = frozenset({-BLOCKED_SIGNAL, 128 + BLOCKED_SIGNAL})


def _passed(run: CaseRun, want: str | None) -> bool:
    """The run ended by itself, exit 0, with the wanted output (if any)."""
    return run.status == "ok" and run.code == 0 and (want is None or _same_output(run.out, want))


def _same_output(got: str, want: str) -> bool:
    return [line.rstrip() for line in got.rstrip().splitlines()] == [line.rstrip() for line in want.rstrip().splitlines()]


def check(response: str, answer: str, cfg: SandboxConfig) -> SandboxResult:
    """Score one response against its task's tests (never raises): 1.0 when every test passes, else 0.0, or with
    `cfg.partial_credit` the share of stdin/stdout cases passed (every case run)."""
    t0 = time.perf_counter()
    try:
        tests = parse_tests(answer)
    except ValueError as e:
        return SandboxResult(0.0, "bad_tests", time.perf_counter() - t0, str(e))
    language, program = extract(response)
    partial = cfg.partial_credit and tests.asserts is None
    if tests.asserts is not None:
        if language == "cpp":
            return SandboxResult(0.0, "error", time.perf_counter() - t0, "a C++ program for assert-style (Python) "
                                 "tests: the task wants Python")
        runs, wants = run_program(program + "\n\n" + tests.asserts + "\n", None, cfg), [None]
    else:
        wants = [w for _, w in tests.cases]
        runs = run_program(program, [stdin for stdin, _ in tests.cases], cfg, wants, every_case=partial,
                           language=language)
    verdicts = [_verdict(i, run, want, cfg) for i, (run, want) in enumerate(zip(runs, wants))]
    failures = [v for v in verdicts if v is not None]
    if len(runs) < len(wants) and not failures:  # cannot happen: the launcher stops early only at a failing case
        failures.append(("error", f"{len(runs)} of {len(wants)} cases ran"))
    seconds = time.perf_counter() - t0
    if not failures:
        return SandboxResult(1.0, "passed", seconds)
    score = verdicts.count(None) / len(wants) if partial else 0.0
    failed = next((run for run, v in zip(runs, verdicts) if v is not None), None)
    return SandboxResult(score, failures[0][0], seconds, failures[0][1], failed.out[:200] if failed else "")


def _verdict(i: int, run: CaseRun, want: str | None, cfg: SandboxConfig) -> tuple[str, str] | None:
    """None when run `i` passed, else its status (failed, error, timeout) and what went wrong."""
    if _passed(run, want):
        return None
    if run.status == "blocked" or (run.status == "ok" and run.code in _BLOCKED_CODES and cfg.isolation is
                                   SandboxIsolation.kernel):
        return "blocked", f"run {i}: the box stopped it (a system call a program may not make: docs/security.md)"
    if run.status != "ok":
        detail = {"timeout": f"over {cfg.timeout_s} s", "output": f"over {cfg.max_output_kb} KiB of output",
                  "early_exit": "exited before the tests ran to the end",
                  "error": f"the sandbox failed: {run.err.strip()[-300:]}",
                  "compile_error": f"the compile failed (exit {run.code}): {run.err.strip()[:300]}",  # the first error
                  "compile_timeout": f"the compile took over {cfg.compile_timeout_s} s"}[run.status]
        return "timeout" if run.status.endswith("timeout") else "error", f"run {i}: {detail}"
    if run.code != 0:
        failed = "AssertionError" in run.err  # a test that does not hold, not a program that breaks
        return "failed" if failed else "error", f"run {i}: exit {run.code}: {run.err.strip()[-300:]}"
    return "failed", f"case {i}: expected {want[:80]!r}, got {run.out[:80]!r}"


def check_batch(responses: Sequence[str], answers: Sequence[str], cfg: SandboxConfig) -> list[SandboxResult]:
    """`check` for every response, `cfg.processes` programs at a time, in order."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses and {len(answers)} answers: give one answer per response")
    if cfg.processes == 1 or len(responses) <= 1:
        return [check(r, a, cfg) for r, a in zip(responses, answers)]
    with ThreadPoolExecutor(max_workers=cfg.processes, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda ra: check(ra[0], ra[1], cfg), zip(responses, answers)))
