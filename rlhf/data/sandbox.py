"""The code verifier (`reward.kind: code`): run the program a response wrote against the task's tests.

A task's reference answer holds its tests, in one of two forms:

    assert-style   Python run after the program, e.g. `assert add(2, 3) == 5` (LeetCode / HumanEval style)
    stdin/stdout   JSON `{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}` (APPS / CodeContests style):
                   the program reads each input on stdin; its stdout must equal the output, compared line by
                   line with trailing whitespace ignored

The program is the last fenced code block of the response (```python ... ``` or ``` ... ```), or the whole
response when it has none. A response scores 1.0 when every test passes, else 0.0 (sparse, as DeepCoder and
verl's code rewards score); it never raises: a syntax error, an exception, a wrong output, a timeout or a
memory blow-up all score 0 (`SandboxResult.status` says which).

Each run is a fresh `python -I -S` process (no site-packages, no user site, no PYTHON* variables; with
`site_packages` the worker's installed packages are importable) in its own temporary directory
(its cwd and HOME, removed afterwards) and its own session, under resource limits: address space
(`memory_mb`), CPU seconds and a wall-clock `timeout_s`, file size, no core files; stdout and stderr capped at
`max_output_kb`. At the end of every run, passed or killed, its process group and every process left in its
session are killed, so a program that started children leaves none behind. This is a process sandbox with limits, not a security boundary: the
program can read what the worker's user can and reach the network; run untrusted code at scale in reward
workers inside containers without network (docs/code_reward.md).
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rlhf.schema import SandboxConfig

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_program(response: str) -> str:
    """The last fenced code block's body (```python ... ```, ```py, or a bare ```), else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1][1] if blocks else response


@dataclass(frozen=True)
class Tests:
    asserts: str | None = None  # Python run after the program
    cases: tuple[tuple[str, str], ...] = ()  # (stdin, expected stdout)


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
    status: str  # passed | failed | error | timeout | bad_tests
    seconds: float
    detail: str = ""  # the failing case, or the tail of stderr


# Sets the limits inside the child, then runs the program as __main__ (no preexec_fn: the reward worker has
# threads, and a fork with threads must exec at once). A run counts as finished only when the launcher gets
# past the program and writes a nonce the program never sees (read from a pipe, closed before the program
# starts) to `done`: a program that exits early (`sys.exit(0)` before the asserts, `os._exit`) fails. With
# stdin/stdout tests `sys.exit(0)` is a normal end.
_LAUNCH = """\
import os, resource, runpy, sys
mem, cpu, size, fd = (int(v) for v in sys.argv[1:5])
exit_ok = sys.argv[5] == "stdio"
nonce = os.read(fd, 64)
os.close(fd)
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = ["main.py"]
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit as e:
    if not exit_ok or e.code not in (None, 0):
        raise
sys.stdout.flush()
with open("done", "wb") as f:
    f.write(nonce)
"""


def _wait(proc: subprocess.Popen, timeout: float) -> None:
    """`proc.wait(timeout)` woken by the exit itself (a pidfd), not by Popen's polling, which sleeps up to 50 ms
    between looks: most programs here run for tens of milliseconds."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # not Linux >= 5.3
        proc.wait(timeout=timeout)
        return
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait()


def _session_members(sid: int) -> list[int]:
    """Processes in session `sid` (from /proc; none where /proc is missing)."""
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(fields[3]) == sid:
                pids.append(int(entry))
    return pids


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the run's process group and every process left in its session (a child that moved to a group of its
    own too; one that called setsid() escapes: hence containers for untrusted code)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in _session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_once(source: str, stdin: str, cfg: SandboxConfig, stdio: bool) -> tuple[str, int | None, str, str]:
    """(status, exit code, stdout, stderr) of one run of `source`; status ok | timeout | output | early_exit.

    stdin, stdout and stderr are files in the run's directory: the output is capped by the file-size limit
    (a write past it fails), never read into the worker's memory unbounded."""
    cap = cfg.max_output_kb * 1024
    with tempfile.TemporaryDirectory(prefix="rlhf-sandbox-") as d:
        with open(os.path.join(d, "main.py"), "w", encoding="utf-8") as f:
            f.write(source)
        with open(os.path.join(d, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": d, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        nonce = secrets.token_hex(16).encode()
        r, w = os.pipe()
        os.write(w, nonce)
        os.close(w)
        args = [str(cfg.memory_mb * 1024 * 1024), str(int(cfg.timeout_s) + 1), str(cap), str(r),
                "stdio" if stdio else "asserts"]
        with open(os.path.join(d, "stdin"), "rb") as fin, open(os.path.join(d, "stdout"), "wb") as fout, \
                open(os.path.join(d, "stderr"), "wb") as ferr:
            try:
                flags = ["-I"] if cfg.site_packages else ["-I", "-S"]
                proc = subprocess.Popen([sys.executable, *flags, "-c", _LAUNCH, *args], cwd=d, env=env, stdin=fin,
                                        stdout=fout, stderr=ferr, start_new_session=True, pass_fds=(r,))
            finally:
                os.close(r)
            try:
                _wait(proc, cfg.timeout_s)
                status = "ok"
            except subprocess.TimeoutExpired:
                status = "timeout"
            finally:
                _kill_group(proc)  # on timeout, and the children it started even after it exited
                proc.wait()
        if status == "ok" and proc.returncode != 0 and max(os.path.getsize(os.path.join(d, n)) for n in
                                                          ("stdout", "stderr")) >= cap:
            status = "output"  # the file-size limit stopped it (Python ignores SIGXFSZ: a write fails with EFBIG)
        done = os.path.join(d, "done")
        if status == "ok" and proc.returncode == 0 and not (os.path.exists(done) and Path(done).read_bytes() == nonce):
            status = "early_exit"
        with open(os.path.join(d, "stdout"), "rb") as f:
            out = f.read(cap)
        with open(os.path.join(d, "stderr"), "rb") as f:
            f.seek(max(0, os.path.getsize(f.name) - 2000))
            err = f.read()
        return status, proc.returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")


def _same_output(got: str, want: str) -> bool:
    return [line.rstrip() for line in got.rstrip().splitlines()] == [line.rstrip() for line in want.rstrip().splitlines()]


def check(response: str, answer: str, cfg: SandboxConfig) -> SandboxResult:
    """Score one response against its task's tests (never raises)."""
    t0 = time.perf_counter()
    try:
        tests = parse_tests(answer)
    except ValueError as e:
        return SandboxResult(0.0, "bad_tests", time.perf_counter() - t0, str(e))
    program = extract_program(response)
    runs = [(program + "\n\n" + tests.asserts + "\n", "", None)] if tests.asserts is not None else \
        [(program, stdin, want) for stdin, want in tests.cases]
    for i, (source, stdin, want) in enumerate(runs):
        status, code, out, err = run_once(source, stdin, cfg, stdio=want is not None)
        if status != "ok":
            detail = {"timeout": f"over {cfg.timeout_s} s", "output": f"over {cfg.max_output_kb} KiB of output",
                      "early_exit": "exited before the tests ran to the end"}[status]
            return SandboxResult(0.0, "timeout" if status == "timeout" else "error", time.perf_counter() - t0,
                                 f"run {i}: {detail}")
        if code != 0:
            failed = "AssertionError" in err  # a test that does not hold, not a program that breaks
            return SandboxResult(0.0, "failed" if failed else "error", time.perf_counter() - t0,
                                 f"run {i}: exit {code}: {err.strip()[-300:]}")
        if want is not None and not _same_output(out, want):
            return SandboxResult(0.0, "failed", time.perf_counter() - t0,
                                 f"case {i}: expected {want[:80]!r}, got {out[:80]!r}")
    return SandboxResult(1.0, "passed", time.perf_counter() - t0)


def check_batch(responses: Sequence[str], answers: Sequence[str], cfg: SandboxConfig) -> list[SandboxResult]:
    """`check` for every response, `cfg.processes` programs at a time, in order."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses and {len(answers)} answers: give one answer per response")
    if cfg.processes == 1 or len(responses) <= 1:
        return [check(r, a, cfg) for r, a in zip(responses, answers)]
    with ThreadPoolExecutor(max_workers=cfg.processes, thread_name_prefix="sandbox") as pool:
        return list(pool.map(lambda ra: check(ra[0], ra[1], cfg), zip(responses, answers)))
