"""Directories a process keeps under a name that carries its pid, removed by the next process that finds their
owner gone (killed, crashed): vLLM's socket directories (actors/vllm_platform.py) and the code verifier's
precompiled headers (rlhf/data/sandbox_cpp.py)."""

from __future__ import annotations

import os
import shutil
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
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed
