"""Run a function on N local processes joined in one torch.distributed group (tests, benchmarks).

Each process initialises the group (gloo by default) with a collective timeout, runs `fn(rank, *args)`
and sends back its result. A failure in any rank is raised in the caller with that rank's traceback;
a rank that hangs past `timeout_s` gets every process killed and a TimeoutError, never a stall.

`RankPool` keeps the processes between calls (a test session's many small groups: starting a process and
importing torch and the caller's module costs seconds per call on 2 cores). Every call still forms a fresh
group on a fresh port, and a call that fails or hangs ends every pooled process: the next call starts new ones.
"""

from __future__ import annotations

import io
import itertools
import os
import queue
import socket
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf.host_memory import small_onednn_cache
from rlhf.parallel.comm import init_process_group

PARENT_POLL_S = 5.0  # a pooled process whose parent is gone exits within this


def free_port() -> int:
    """A port free on every interface (torch's TCPStore listens on all of them)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, results, args, collective_timeout_s, threads, call=None,
           device_type="cpu", backend="auto"):
    small_onednn_cache()  # as a trainer rank's process does (a pooled process keeps what its first call set)
    torch.set_num_threads(threads)
    try:
        init_process_group(rank, world_size, "127.0.0.1", port, device_type, backend, collective_timeout_s)
        out = fn(rank, *args)
        buf = io.BytesIO()
        torch.save(out, buf)  # plain bytes: shared-memory tensors would die with this process
        results.put((call, rank, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt, to the parent
        results.put((call, rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(results, procs: list, timeout_s: float, call=None) -> list[Any]:
    """Every rank's result from `results`, in rank order; a failed rank (its traceback), a dead process or the
    deadline raised."""
    world_size = len(procs)
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish within "
                               f"{timeout_s:.0f} s")
        try:
            tag, rank, ok, payload = results.get(timeout=min(remaining, 5.0))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out and p.exitcode not in (0, None)]
            if dead:
                raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            continue
        if tag != call:  # not expected: a pool whose call failed is ended together with its queue
            continue
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [out[r] for r in range(world_size)]


def run_ranks(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 300.0,
              collective_timeout_s: float = 60.0, threads: int = 1, device_type: str = "cpu",
              backend: str = "auto") -> list[Any]:
    """[fn(0, *args), ..., fn(world_size - 1, *args)], each in its own process (a pooled one while
    `using(pool)` is active and the pool is large enough). `device_type` picks the group's backend (gloo on
    cpu, nccl on cuda, hccl on npu) unless `backend` names one."""
    if _pool is not None and world_size <= _pool.size and device_type == "cpu" and backend == "auto":
        return _pool.run(fn, world_size, args, timeout_s, collective_timeout_s, threads)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, collective_timeout_s, threads,
                                              None, device_type, backend),
                         daemon=False) for r in range(world_size)]  # a rank may start processes (vLLM)
    for p in procs:
        p.start()
    try:
        return _collect(results, procs, timeout_s)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def _pool_worker(tasks, results, parent: int) -> None:
    """A pooled process: runs tasks as `_entry` does until told to stop (None) or orphaned. What a task may
    change process-wide is put back afterwards (environment, default dtype, grad mode) and the random seed
    drawn afresh, as a new process would have them."""
    while True:
        try:
            task = tasks.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        env, dtype = dict(os.environ), torch.get_default_dtype()
        torch.seed()
        try:
            fn, rank, world_size, port, args, collective_timeout_s, threads, call = task
            _entry(fn, rank, world_size, port, results, args, collective_timeout_s, threads, call)
        finally:
            os.environ.clear()
            os.environ.update(env)
            torch.set_default_dtype(dtype)
            torch.set_grad_enabled(True)


class RankPool:
    """`size` processes kept for the `run_ranks` calls made inside `using(pool)`; started on first use."""

    def __init__(self, size: int):
        self.size = size
        self.ctx = mp.get_context("spawn")
        self.procs: list = []
        self.tasks: list = []
        self.results = None
        self.calls = itertools.count()

    def _start(self) -> None:
        self.results = self.ctx.Queue()
        self.tasks = [self.ctx.Queue() for _ in range(self.size)]
        self.procs = [self.ctx.Process(target=_pool_worker, args=(q, self.results, os.getpid()), daemon=False)
                      for q in self.tasks]  # not daemonic: a task may start processes of its own
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], world_size: int, args: tuple, timeout_s: float,
            collective_timeout_s: float, threads: int) -> list[Any]:
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        call, port = next(self.calls), free_port()
        for r in range(world_size):
            self.tasks[r].put((fn, r, world_size, port, args, collective_timeout_s, threads, call))
        try:
            return _collect(self.results, self.procs[:world_size], timeout_s, call)
        except BaseException:
            self.close(grace_s=0)  # a failed or hung rank: its peers may wait in a collective until their timeout
            raise

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every pooled process (killed after `grace_s`)."""
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=grace_s)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for q in [*self.tasks, *([self.results] if self.results is not None else [])]:
            q.close()
            q.join_thread()
        self.procs, self.tasks, self.results = [], [], None


_pool: RankPool | None = None


@contextmanager
def using(pool: RankPool) -> Iterator[RankPool]:
    """`run_ranks` calls of up to `pool.size` ranks run on the pool's processes while the block runs."""
    global _pool
    before, _pool = _pool, pool
    try:
        yield pool
    finally:
        _pool = before
