"""Process groups of a layout, the collective backend per device type, and autograd-aware collectives.

The backend is chosen once from the device type: gloo on cpu, nccl on cuda, hccl on npu (torch_npu is
imported only then). Every group is created with the run's timeout, so a hung collective raises
instead of stalling.

Autograd collectives (Megatron's f/g pairs, plus the sequence split and the all-to-all of EP):
  copy_to_group      forward identity,          backward all-reduce
  reduce_from_group  forward all-reduce,        backward identity
  split_to_group     forward keep own slice,    backward all-gather
  gather_from_group  forward all-gather,        backward keep own slice
  all_to_all         forward all_to_all_single, backward the reverse all_to_all_single
"""

from __future__ import annotations

import datetime
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.sharding.layout import Layout
from weight_sync.store import tcp_store

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the group's timeout: a peer rank stopped taking part."""


@contextmanager
def bounded(phase: str, rank: int, timeout_s: float):
    """Name the rank and the phase in a collective's timeout (the backend's own message says neither)."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, CollectiveTimeout) or "timed out" not in str(e).lower():
            raise
        raise CollectiveTimeout(f"trainer rank {rank}: {phase}: a collective waited longer than "
                                f"trainer.collective_timeout_s={timeout_s:g} s; a peer rank stopped taking part "
                                f"(its own error or log says why) [{e}]") from e


def backend_for(device_type: str, requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    if device_type not in BACKENDS:
        raise ValueError(f"device type {device_type!r}: use one of {sorted(BACKENDS)}")
    if device_type == "npu":
        import torch_npu  # noqa: F401  (registers the hccl backend)
    return BACKENDS[device_type]


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device_type: str = "cpu",
                       backend: str = "auto", timeout_s: float = 120.0) -> None:
    """The default group, its store hosted by rank 0 at master_addr:master_port and listening there alone
    (127.0.0.1 for a local run: weight_sync.store)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tcp_store(master_addr, master_port, world_size, rank == 0, timeout)
    dist.init_process_group(backend_for(device_type, backend), store=store, rank=rank, world_size=world_size,
                            timeout=timeout)


@dataclass
class LayoutGroups:
    """This rank's process groups along every axis of the layout (None where the group is one rank)."""

    layout: Layout
    rank: int
    tp: object
    dp: object
    pp: object
    ep: object
    expert_replica: object
    stage: object
    ranks: dict  # axis -> tuple of global ranks of this rank's group
    # tp > KV heads: the TP ranks holding the same (replicated) KV head; their k/v gradients are summed
    kv_head: object = None

    def size(self, axis: str) -> int:
        return len(self.ranks[axis])

    def index(self, axis: str) -> int:
        return self.ranks[axis].index(self.rank)


def kv_head_groups(layout: Layout, kv_heads: int) -> tuple[tuple[int, ...], ...]:
    """tp > KV heads: each KV head is replicated on tp / kv_heads consecutive TP ranks (rank t holds head
    t * kv_heads // tp). One group per (stage, DP index, head); none when tp <= kv_heads."""
    if layout.tp <= kv_heads:
        return ()
    per = layout.tp // kv_heads
    return tuple(tuple(range(first, first + per)) for first in range(0, layout.world_size, per))


def build_groups(layout: Layout, rank: int, timeout_s: float = 120.0, kv_heads: int | None = None) -> LayoutGroups:
    """Create every group of every axis (all ranks must call this, in the same order). `kv_heads`: the
    model's KV heads, for the groups that share a replicated KV head when tp exceeds them."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the process group has "
                         f"{dist.get_world_size()}")
    timeout = datetime.timedelta(seconds=timeout_s)
    mine, ranks = {}, {}
    for axis in ("tp", "dp", "pp", "ep", "expert_replica", "stage"):
        for g in layout.groups(axis):
            handle = dist.new_group(list(g), timeout=timeout) if len(g) > 1 else None
            if rank in g:
                mine[axis], ranks[axis] = handle, g
    ranks["kv_head"] = (rank,)
    for g in kv_head_groups(layout, kv_heads or layout.tp):
        handle = dist.new_group(list(g), timeout=timeout)
        if rank in g:
            mine["kv_head"], ranks["kv_head"] = handle, g
    return LayoutGroups(layout, rank, ranks=ranks, **mine)


# torch >= 2.10 names the flat-tensor collectives *_single; older ones *_into_tensor / *_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def all_reduce_bucketed(tensors: list[torch.Tensor], group, bucket_bytes: int = 32 << 20) -> None:
    """Sum the tensors over `group`: flat all-reduces of about `bucket_bytes` each (a tensor larger than that
    alone), so the copy made for them is one bucket at a time, not all of them at once; none where a bucket's
    tensors lie back to back in one storage (the trainer's gradient buffer on cpu): the collective then runs on
    a view of them (the same bytes in the same order, so the same sums)."""
    if group is None:
        return
    for bucket in _buckets(tensors, bucket_bytes):
        together = flat_view(bucket, 0, sum(t.numel() for t in bucket))
        if together is not None:
            all_reduce(together, group)
            continue
        flat = all_reduce(torch.cat([t.reshape(-1) for t in bucket]), group)
        for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
            t.copy_(part.view_as(t))


def flat_view(tensors, lo: int, hi: int) -> torch.Tensor | None:
    """The flat range [lo, hi) of the tensors laid end to end, as one view, where they lie back to back in one
    storage, each contiguous; else None."""
    if not tensors or any(t is None or not t.is_contiguous() or t.dtype != tensors[0].dtype for t in tensors):
        return None
    storage, item = tensors[0].untyped_storage(), tensors[0].element_size()
    end = tensors[0].data_ptr()
    for t in tensors:
        if t.data_ptr() != end or t.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        end += t.numel() * item
    first = (tensors[0].data_ptr() - storage.data_ptr()) // item
    return tensors[0].new_empty(0).set_(storage, first + lo, (hi - lo,), (1,))


def _buckets(tensors: list[torch.Tensor], limit: int):
    """Consecutive runs of `tensors` of at most `limit` bytes each (a larger tensor alone)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and size + t.nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.nbytes
    if bucket:
        yield bucket


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


class _SplitToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        n, i = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n, dim)[i].contiguous()

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, ctx.dim), None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        n, i = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return g.chunk(n, ctx.dim)[i].contiguous(), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.group, ctx.send_counts, ctx.recv_counts = group, send_counts, recv_counts
        out = x.new_empty((sum(recv_counts),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((sum(ctx.send_counts),) + tuple(g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send_counts, ctx.recv_counts, group=ctx.group)
        return out, None, None, None


def copy_to_group(x, group):
    return x if group is None else _CopyToGroup.apply(x, group)


def reduce_from_group(x, group):
    return x if group is None else _ReduceFromGroup.apply(x, group)


def split_to_group(x, group, dim: int = 0):
    return x if group is None else _SplitToGroup.apply(x, group, dim)


def gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every member's rows of an integer or bool tensor, in member order; not differentiable (gloo has no
    int16 or bool collectives, so they travel as int32)."""
    return x if group is None else _gather(x.to(torch.int32), group, 0).to(x.dtype)


def gather_from_group(x, group, dim: int = 0):
    return x if group is None else _GatherFromGroup.apply(x, group, dim)


def all_to_all(x, send_counts: list[int], recv_counts: list[int], group):
    """Rows of x go to group members in order, `send_counts[i]` rows to member i; differentiable."""
    if group is None:
        return x
    return _AllToAll.apply(x, list(send_counts), list(recv_counts), group)


def exchange_counts(send_counts: list[int], group, device: torch.device | str = "cpu") -> list[int]:
    """How many rows each member will send us, given how many we send each. `device`: where the group's
    backend takes tensors (nccl and hccl take only device tensors)."""
    if group is None:
        return list(send_counts)
    send = torch.tensor(send_counts, dtype=torch.long, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.tolist()
