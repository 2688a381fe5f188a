"""What a killed process leaves behind, and where. Directories a process keeps under a name that carries its pid,
removed by the next process that finds their owner gone (killed, crashed): vLLM's socket directories
(actors/vllm/platform.py), the code verifier's precompiled headers (rlhf/data/sandbox_cpp.py) and its box's
directories (rlhf/data/sandbox_box.py). And the temp
directory pointed elsewhere while a library makes the temp files it removes only at a normal exit (`temp_dir`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether process `pid` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_dead_process_dirs(base: str, prefix: str) -> list[str]:
    """Remove the directories `base/<prefix><pid>` (or `<prefix><pid>-<anything>`) whose process is gone; their
    names."""
    removed = []
    for path in Path(base).glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            with contextlib.suppress(OSError):
                os.chmod(path, 0o700)  # one its owner kept unlistable (the code verifier's box scratch)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def release_programs() -> None:
    """The code verifier's warm interpreters stopped and its directories removed in this process, if it ran any
    (`rlhf.data.sandbox.release`): by a reward or environment worker before it is killed (a killed Ray actor runs
    no exit handler, and would leave them until the next worker on the machine cleared them), and by the driver
    as its run closes (held-out evaluation runs the verifier in the driver)."""
    import sys

    sandbox = sys.modules.get("rlhf.data.sandbox")
    if sandbox is not None:
        sandbox.release()


@contextlib.contextmanager
def temp_dir(target: str | os.PathLike):
    """While the block runs, this process's temp directory (`tempfile`'s, and TMPDIR for the processes it starts)
    is `target`; put back as it was afterwards, also when the block raises."""
    target = str(target)
    before_env, before_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = target
    try:
        yield
    finally:
        tempfile.tempdir = before_cached
        if before_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before_env
