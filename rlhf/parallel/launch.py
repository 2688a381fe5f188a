"""Run a function on N local processes joined in one torch.distributed group (tests, benchmarks).

Each process initialises the group (gloo by default) with a collective timeout, runs `fn(rank, *args)`
and sends back its result. A failure in any rank is raised in the caller with that rank's traceback;
a rank that hangs past `timeout_s` gets every process killed and a TimeoutError, never a stall.
"""

from __future__ import annotations

import io
import queue
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.parallel.comm import init_process_group


def free_port() -> int:
    """A port free on every interface (torch's TCPStore listens on all of them)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, results, args, collective_timeout_s, threads):
    torch.set_num_threads(threads)
    try:
        init_process_group(rank, world_size, "127.0.0.1", port, "cpu", timeout_s=collective_timeout_s)
        out = fn(rank, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: shared-memory tensors would die with this process
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 300.0,
              collective_timeout_s: float = 60.0, threads: int = 1) -> list[Any]:
    """[fn(0, *args), ..., fn(world_size - 1, *args)], each in its own process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, collective_timeout_s, threads),
                         daemon=False) for r in range(world_size)]  # a rank may start processes (vLLM)
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish within "
                                   f"{timeout_s:.0f} s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 5.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
