"""Routed SwiGLU experts over rows: each row goes through the expert it was routed to, the experts' weights stacked
(`gate_up` [E, 2I, H], gate rows first; `down` [E, H, I]).

Two kernels with the same maths. `grouped_swiglu` lays the rows out grouped by expert (each group padded with zero
rows to a multiple, where the kernel wants one) and runs one grouped matrix multiply per projection over all experts
(`torch._grouped_mm`, forward and backward: torch's own kernels on cuda, one C++ loop of matmuls on cpu). The
loop, `looped_swiglu`, makes two Python-level matmuls per expert; it is the reference the tests compare with, and
the path where torch has no grouped multiply for a device and dtype (cuda takes bf16 only).

Rows stay in the layout expert parallelism and routing replay give them (any order, any expert per row); only the
row counts per expert matter, and an expert with no row costs nothing.

Legend: R rows, H hidden, I expert FFN size, E experts in the stack, P rows once grouped and padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf.model.layers import inverse_permutation, permute_rows


def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` multiplies `dtype` on this device type: every float dtype on cpu, bf16 on
    cuda (torch's check); elsewhere (npu) the loop until its kernel is wired in."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return device_type == "cuda" and dtype is torch.bfloat16


def grouped_mm_fits(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the stacks meet `torch._grouped_mm`'s layout rules: every operand's strides (rows of H and of I
    elements) a multiple of 16 bytes and the stacks' data 16-byte aligned (cuda's kernels load by 16 bytes; torch
    refuses other strides on cpu too). A model whose hidden or expert size breaks them takes the loop."""
    size = gate_up.element_size()
    H, I = down.shape[1], down.shape[2]
    return (H * size) % 16 == 0 and (I * size) % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (gate_up, down))


@dataclass(frozen=True)
class GroupedRows:
    """Where each row goes once the rows are grouped by expert: `dest_R` its row in the grouped buffer of `rows`
    rows (each expert's group starting at a multiple of `multiple`, unused rows zero), `offs_E` each group's end
    (int32, what `torch._grouped_mm` takes)."""

    dest_R: torch.Tensor
    offs_E: torch.Tensor
    rows: int

    @staticmethod
    def of(expert_R: torch.Tensor, num_experts: int, multiple: int = 1) -> "GroupedRows":
        counts_E = torch.bincount(expert_R, minlength=num_experts)
        padded_E = counts_E if multiple == 1 else (counts_E + multiple - 1) // multiple * multiple
        ends_E = padded_E.cumsum(0)
        # a row's place among the sorted rows, moved by how far its group starts past where the sort put it
        rank_R = inverse_permutation(torch.argsort(expert_R, stable=True))
        shift_E = (ends_E - padded_E) - (counts_E.cumsum(0) - counts_E)
        dest_R = rank_R + shift_E[expert_R] if multiple > 1 else rank_R
        rows = int(ends_E[-1]) if num_experts else 0
        return GroupedRows(dest_R, ends_E.to(torch.int32), rows)


def _buffer(like: torch.Tensor, rows: int) -> torch.Tensor:
    """Rows for `like`'s rows to be written into: zeros where some stay unwritten (padding), else uninitialised (no
    row is padding, as in fp32: a permutation, every row written)."""
    if rows == like.shape[0]:
        return like.new_empty(rows, like.shape[1])
    return like.new_zeros(rows, like.shape[1])


class _ScatterRows(torch.autograd.Function):
    """x's rows written to rows `dest` of a zero buffer of `rows` rows; the gradient gathers them back."""

    @staticmethod
    def forward(ctx, x, dest, rows):
        ctx.save_for_backward(dest)
        return _buffer(x, rows).index_copy_(0, dest, x)

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        return grad.index_select(0, dest), None, None


class _GatherRows(torch.autograd.Function):
    """Rows `dest` of y; the gradient is written back to those rows of a zero buffer (padding rows get none)."""

    @staticmethod
    def forward(ctx, y, dest):
        ctx.save_for_backward(dest)
        ctx.rows = y.shape[0]
        return y.index_select(0, dest)

    @staticmethod
    def backward(ctx, grad):
        (dest,) = ctx.saved_tensors
        return _buffer(grad, ctx.rows).index_copy_(0, dest, grad), None


def grouped_swiglu(x_RH: torch.Tensor, expert_R: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   multiple: int = 1) -> torch.Tensor:
    """Row r through SwiGLU expert `expert_R[r]`: two grouped multiplies over every expert of the stacks, in the
    dtype of `gate_up` and `down` (x is cast to it). `multiple`: each expert's rows padded to a multiple of it."""
    layout = GroupedRows.of(expert_R, gate_up.shape[0], multiple)
    dtype = gate_up.dtype
    x_PH = _ScatterRows.apply(x_RH.to(dtype), layout.dest_R, layout.rows)
    gate, up = torch._grouped_mm(x_PH, gate_up.transpose(1, 2), offs=layout.offs_E).chunk(2, dim=-1)
    y_PH = torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=layout.offs_E)
    return _GatherRows.apply(y_PH, layout.dest_R)


def looped_swiglu(x_RH: torch.Tensor, expert_R: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  multiple: int = 1) -> torch.Tensor:
    """The same as `grouped_swiglu`, two matmuls per expert with rows, under whatever autocast is on."""
    order = torch.argsort(expert_R, stable=True)
    counts = torch.bincount(expert_R, minlength=gate_up.shape[0]).tolist()
    # Views per expert from one unbind of each stack and one split of the sorted rows: indexing or slicing them once
    # per expert would make each expert's backward write a zero gradient the size of the whole stack (or of all
    # rows) and add it up, E times per layer.
    inverse = inverse_permutation(order)
    rows = permute_rows(x_RH.to(gate_up.dtype), order, inverse).split(counts)
    gate_up, down = gate_up.unbind(0), down.unbind(0)
    ys = []
    for e, n in enumerate(counts):
        if n:
            r = rows[e] if n % multiple == 0 else F.pad(rows[e], (0, 0, 0, multiple - n % multiple))
            gate, up = F.linear(r, gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[e])
            ys.append(y if y.shape[0] == n else y[:n])  # zero rows in, their outputs dropped: no gradient
    return permute_rows(torch.cat(ys), inverse, order)
