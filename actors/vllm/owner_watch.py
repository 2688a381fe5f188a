"""An engine core vLLM starts in its own process (`VLLM::EngineCore`: an engine made in a test or notebook process,
or `rollout.engine_core_in_process=false`) outlives its parent when the parent is killed: nothing in vLLM 0.32 tells
it the frontend is gone, and a SIGTERM that reaches it while it is still starting waits out the start. Its workers
do follow it (they watch a pipe from it), so the engine core is the one process that must notice.

`prepare_platform` names the engine's owner in the environment (`RLHF_VLLM_OWNER_PID`, inherited by every process
vLLM starts), and vLLM loads `register` as a general plugin (entry point `vllm.general_plugins`, pyproject.toml) in
each of its processes: the engine core at its start, the workers at theirs. Any such process other than the owner
itself watches the owner (a pidfd: woken by the owner's exit, no polling, no mistaking a reused pid) and, once the
owner is gone, asks itself to stop as vLLM's own shutdown does (SIGTERM: the busy loop ends, the executor's workers
are closed and their shared memory unlinked), then exits outright if it has not after `grace_s`."""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time

log = logging.getLogger(__name__)

OWNER_ENV = "RLHF_VLLM_OWNER_PID"  # set by actors.vllm.platform.prepare_platform
PLUGIN = "rlhf_owner_watch"  # the entry point's name (pyproject.toml), for a VLLM_PLUGINS allow-list
GRACE_ENV = "RLHF_VLLM_ORPHAN_GRACE_S"
GRACE_S = 30.0  # how long a clean stop may take once the owner is gone, before the process exits outright
_watching: int | None = None  # the owner this process watches


def register() -> None:
    """vLLM's general-plugin hook: watch the owner named in the environment, if this process is not the owner (an
    in-process engine core loads plugins in the owner itself). Idempotent; vLLM calls it once a process."""
    owner = os.environ.get(OWNER_ENV, "")
    if not owner.isdigit() or int(owner) == os.getpid():
        return
    watch(int(owner), float(os.environ.get(GRACE_ENV, GRACE_S)))


def watch(owner: int, grace_s: float = GRACE_S) -> bool:
    """Start a daemon thread that ends this process once process `owner` exits (at once if it is gone already).
    False if this process watches `owner` already."""
    global _watching
    if _watching == owner:
        return False
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):  # gone already, or no pidfd (Linux < 5.3, another OS): poll the pid
        fd = None
    _watching = owner
    threading.Thread(target=_wait_then_stop, args=(owner, fd, grace_s), name="rlhf-owner-watch", daemon=True).start()
    return True


def _wait_then_stop(owner: int, fd: int | None, grace_s: float) -> None:
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
        os.close(fd)
    else:
        from rlhf.leftovers import alive

        while alive(owner):
            time.sleep(1.0)
    _owner_gone(owner, grace_s)


def _owner_gone(owner: int, grace_s: float) -> None:
    log.warning("the process that owns this vLLM engine (pid %d) is gone: stopping pid %d", owner, os.getpid())
    os.kill(os.getpid(), signal.SIGTERM)  # vLLM's engine core and workers stop cleanly on it
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
    log.warning("pid %d did not stop within %.0f s of its owner's end: exiting", os.getpid(), grace_s)
    os._exit(1)
