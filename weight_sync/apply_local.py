"""The in-process executor: run a `Plan` by copying regions between torch tensors held in one process.

Used by tests and by the co-located local path (a role's engine and trainer buffers in one process).
Every transfer copies its region with slicing on both sides (views of the buffers): no full tensor is
gathered, and destination elements no transfer names (vocabulary padding) are left as they were.
"""

from __future__ import annotations

from typing import Mapping

import torch

from weight_sync.plan import Plan

Buffers = Mapping[int, Mapping[str, torch.Tensor]]  # rank -> buffer name -> local tensor


def apply_local(plan: Plan, src: Buffers, dst: Buffers) -> int:
    """Copy every transfer of `plan` from `src` buffers into `dst` buffers; returns elements copied.
    A rank may appear in both (co-located): its source and destination buffers are looked up separately."""
    copied = 0
    for (s, d), transfers in plan.pairs:
        src_bufs, dst_bufs = _rank(src, s, "source"), _rank(dst, d, "destination")
        for t in transfers:
            region_src = _buffer(src_bufs, t.src_buffer, s, "source")[t.src_slices()]
            region_dst = _buffer(dst_bufs, t.dst_buffer, d, "destination")[t.dst_slices()]
            if region_src.shape != region_dst.shape or tuple(region_src.shape) != t.shape:
                raise ValueError(f"{t.param}: region {t.box} is {tuple(region_src.shape)} in rank {s} buffer "
                                 f"{t.src_buffer!r} and {tuple(region_dst.shape)} in rank {d} buffer "
                                 f"{t.dst_buffer!r}; the buffers do not match the plan's specs")
            region_dst.copy_(region_src)
            copied += t.numel
    return copied


def _rank(bufs: Buffers, rank: int, side: str) -> Mapping[str, torch.Tensor]:
    if rank not in bufs:
        raise ValueError(f"no {side} buffers for rank {rank}; the plan uses it")
    return bufs[rank]


def _buffer(bufs: Mapping[str, torch.Tensor], name: str, rank: int, side: str) -> torch.Tensor:
    if name not in bufs:
        raise ValueError(f"{side} rank {rank} has no buffer {name!r}; the plan uses it")
    return bufs[name]
