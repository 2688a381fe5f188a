"""C++ programs in the code verifier (rlhf/data/sandbox.py): each compile under limits in a session of its own,
and a precompiled `<bits/stdc++.h>`, the header contest solutions include, built once per reward-worker process.

With g++ 12 at -O2 on this project's machines, a program that includes `<bits/stdc++.h>` took about 1.2 s to
compile, about 17 times its `<cstdio>` twin: the header is most of the work (`python -m benchmarks.sandbox_bench
--language cpp --cpp-include bits/stdc++.h`, docs/code_reward.md). Built once with the compile command's own
flags (a precompiled header only serves compiles with the flags it was built with), it sits in a directory of
this process that each compile searches first (`-I`), as `bits/stdc++.h.gch`: g++ takes it in place of the
header. A header that cannot be precompiled (another compiler, another standard library) is compiled as usual,
with a warning in the log. The directory (about 100 MB) is removed at exit; one whose process was killed, by the
next code reward worker started on the machine, or the next build.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from rlhf.data.sandbox_exec import kill_group
from rlhf.leftovers import remove_dead_process_dirs

log = logging.getLogger(__name__)

# A compile under limits: address space, CPU seconds, file size (the objects and the binary), no core files; then
# the compiler itself.
COMPILE = """\
import os, resource, sys
mem, cpu, size = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execvp(sys.argv[4], sys.argv[4:])
"""
COMPILE_FILE_LIMIT = 256 * 2**20  # the compile's files: a program whose binary would be larger fails to compile
PCH_PREFIX = "rlhf-pch-"  # + the pid of the process whose compiles use it
PCH_TIMEOUT_S = 60.0  # building the precompiled header (3.5-3.7 s for bits/stdc++.h at -O2 here); past it, none


def compile_program(command: list[str], d: str, env: dict, memory: int, timeout: float, log_path: str,
                    box=None) -> int | None:
    """Run `command` (the compiler and its arguments) in directory `d` under limits, its messages into `log_path`:
    its exit code, or None past `timeout` seconds. Every process it started is gone on return. `box`
    (`rlhf.data.sandbox_box.Box`): the compile runs in the box, as the program will."""
    code = (box.sample_code(d) if box is not None else "") + COMPILE
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", code, str(memory), str(int(timeout) + 1),
                                 str(COMPILE_FILE_LIMIT), *command], cwd=d, env=dict(env, TMPDIR=d),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_group(proc.pid)
            proc.wait()


_lock = threading.Lock()
_built: dict[tuple[tuple[str, ...], str], str | None] = {}  # (compile command, header) -> its -I directory


def precompiled(command: list[str], header: str, env: dict, memory: int) -> str | None:
    """The directory holding `header` precompiled for `command` (built on the first call), or None where it
    cannot be built or no header is asked for."""
    if not header:
        return None
    key = (tuple(command), header)
    with _lock:
        if key not in _built:
            _built[key] = _build(command, header, env, memory)
        return _built[key]


def release() -> None:
    """This process's precompiled headers removed now (a Ray actor is killed without running its exit handlers);
    a later compile builds them again."""
    with _lock:
        dirs = [d for d in _built.values() if d]
        _built.clear()
    atexit.unregister(_remove)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _remove(d: str) -> None:
    shutil.rmtree(d, ignore_errors=True)


def _build(command: list[str], header: str, env: dict, memory: int) -> str | None:
    remove_dead_dirs()
    d = tempfile.mkdtemp(prefix=f"{PCH_PREFIX}{os.getpid()}-")
    atexit.register(_remove, d)
    target = Path(d, header + ".gch")
    target.parent.mkdir(parents=True, exist_ok=True)
    Path(d, "pch.hpp").write_text(f"#include <{header}>\n")
    code = compile_program([*command, "-x", "c++-header", "pch.hpp", "-o", str(target)], d, env, memory,
                           PCH_TIMEOUT_S, os.path.join(d, "pch.log"))
    if code != 0:
        text = Path(d, "pch.log").read_text(errors="replace")[-500:]
        log.warning("code verifier: <%s> could not be precompiled (%s); C++ programs compile without it: %s", header,
                    "over %.0f s" % PCH_TIMEOUT_S if code is None else f"exit {code}", text)
        shutil.rmtree(d, ignore_errors=True)
        return None
    for name in ("pch.hpp", "pch.log"):
        os.unlink(os.path.join(d, name))
    return d


def remove_dead_dirs() -> list[str]:
    """Precompiled-header directories of processes that are gone (a reward worker killed before its exit)."""
    return remove_dead_process_dirs(tempfile.gettempdir(), PCH_PREFIX)
