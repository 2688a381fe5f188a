"""Routed SwiGLU experts over rows: each row goes through the expert it was routed to, the experts' weights stacked
(`gate_up` [E, 2I, H], gate rows first; `down` [E, H, I]).

Two kernels with the same maths. `grouped_swiglu` lays the rows out grouped by expert (each group padded with zero
rows to a multiple, where the kernel wants one) and runs one grouped matrix multiply per projection over all experts
(`torch._grouped_mm`: torch's own kernels on cuda, one C++ loop of matmuls on cpu); on cpu the weights' gradients
are made an expert at a time and added into the parameters' fp32 gradients in place (`_GroupedLinear`). The
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

from rlhf.model.layers import (CompiledKernels, EagerKernels, add_into, grad_into, inverse_permutation,
                               permute_rows)


def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` multiplies `dtype` on this device type: every float dtype on cpu, bf16 on
    cuda (torch's check); elsewhere (npu) the loop until its kernel is wired in."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device_type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    return device_type == "cuda" and dtype is torch.bfloat16


def grouped_mm_fits(gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether the stacks (or their casts to `dtype`) meet `torch._grouped_mm`'s layout rules: every operand's
    strides (rows of H and of I elements) a multiple of 16 bytes and the stacks' data 16-byte aligned (cuda's
    kernels load by 16 bytes; torch refuses other strides on cpu too). A model whose hidden or expert size breaks
    them takes the loop."""
    size = (dtype or gate_up.dtype).itemsize
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


def _scatter(x_RH: torch.Tensor, dest_R: torch.Tensor, rows: int) -> torch.Tensor:
    """x's rows at rows `dest_R` of `rows` rows, zeros in the others (padding), made as one gather: each output row
    reads its source row, or a zero row appended to x. On cpu `index_select` moves [2,700, 512] bf16 rows 3x as fast
    as `index_copy_` into a zeroed buffer (0.13 against 0.40 ms, the zeroing and the append included)."""
    R = x_RH.shape[0]
    src_P = torch.full((rows,), R, dtype=torch.long, device=x_RH.device)
    src_P[dest_R] = torch.arange(R, device=x_RH.device)
    if rows > R:
        x_RH = torch.cat([x_RH, x_RH.new_zeros(1, x_RH.shape[1])])
    return x_RH.index_select(0, src_P)


class _ScatterRows(torch.autograd.Function):
    """x's rows written to rows `dest` of a zero buffer of `rows` rows; the gradient gathers them back."""

    @staticmethod
    def forward(ctx, x, dest, rows):
        ctx.save_for_backward(dest)
        return _scatter(x, dest, rows)

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
        return _scatter(grad, dest, ctx.rows), None


def _weight_grads(dy_PN: torch.Tensor, x_PK: torch.Tensor, offs_E: torch.Tensor,
                  into: torch.Tensor | None) -> torch.Tensor | None:
    """Each group's weight gradient dy_e.T @ x_e ([N, K]), one matmul per expert with rows. With `into` (an fp32
    gradient buffer [E, N, K]) each is made in one reused block and added into its expert's part in place, and
    None returned; else the [E, N, K] gradient in the operands' dtype (zeros for experts without rows)."""
    full = None if into is not None else dy_PN.new_zeros(len(offs_E), dy_PN.shape[1], x_PK.shape[1])
    block, start = None, 0
    for e, end in enumerate(offs_E.tolist()):
        if end > start:
            a, b = dy_PN[start:end].T, x_PK[start:end]
            if full is not None:
                torch.mm(a, b, out=full[e])
            else:
                block = torch.mm(a, b) if block is None else torch.mm(a, b, out=block)
                add_into(into[e], block)
        start = end
    return full


class _GroupedLinear(torch.autograd.Function):
    """y = x_e @ w[e].T for each group's rows (`torch._grouped_mm`), with the weight's gradient made an expert at a
    time (`_weight_grads`) and, where `param` (the fp32 parameter `w` was cast from) has a gradient buffer
    (`grad_into`), added into it in place. torch's own backward makes the whole stack's gradient in a fresh tensor
    on every call (8 MB for the small model's gate_up on an EP rank), zero-filled for empty experts, which the
    gradient's cast then adds: on cpu the fresh pages' first touch cost more than the multiplies that filled them
    (docs/throughput.md, "The update"). Gradients for `w` where no `param` is given (a cast made by the caller)."""

    @staticmethod
    def forward(ctx, x_PK, w_ENK, offs_E, param):
        ctx.save_for_backward(x_PK, offs_E)
        ctx.w, ctx.param = w_ENK.detach(), param
        return torch._grouped_mm(x_PK, w_ENK.transpose(1, 2), offs=offs_E)

    @staticmethod
    def backward(ctx, dy_PN):
        x_PK, offs_E = ctx.saved_tensors
        dx = torch._grouped_mm(dy_PN, ctx.w, offs=offs_E) if ctx.needs_input_grad[0] else None
        dw = dparam = None
        if ctx.needs_input_grad[3]:
            into = grad_into(ctx.param)
            g = _weight_grads(dy_PN, x_PK, offs_E, into)
            dparam = None if g is None else g.to(ctx.param.dtype)
        elif ctx.needs_input_grad[1]:
            dw = _weight_grads(dy_PN, x_PK, offs_E, None)
        return dx, dw, None, dparam


def _grouped_linear(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                    param: torch.Tensor | None) -> torch.Tensor:
    """x_PK's groups times their experts' w_ENK.T: our backward on cpu or for a `param`; elsewhere torch's (on cuda
    one grouped kernel makes the stack's gradient)."""
    if x_PK.device.type == "cpu" or param is not None:
        return _GroupedLinear.apply(x_PK, w_ENK, offs_E, param)
    return torch._grouped_mm(x_PK, w_ENK.transpose(1, 2), offs=offs_E)


def swiglu_forward(gu_PJ: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up], in fp32, rounded once to the rows' dtype."""
    gate, up = gu_PJ.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gu_PJ.dtype)


def swiglu_backward(g_PI: torch.Tensor, gu_PJ: torch.Tensor) -> torch.Tensor:
    """dL/d[gate | up] of `swiglu_forward` in the rows' dtype: g up s (1 + gate (1 - s)) and g silu(gate), with
    s = sigmoid(gate)."""
    gu_P2I = gu_PJ.view(gu_PJ.shape[0], 2, -1)  # (stacked into the [P, 2, I] view: compiled, one vectorised loop)
    gate, up = gu_P2I[:, 0].float(), gu_P2I[:, 1].float()
    g, s = g_PI.float(), torch.sigmoid(gate)
    return torch.stack([g * up * s * (1 + gate * (1 - s)), g * gate * s], dim=1).to(gu_PJ.dtype).view(gu_PJ.shape)


SWIGLU_KERNELS = CompiledKernels("the experts' SwiGLU kernels", swiglu_forward, swiglu_backward)
EAGER_SWIGLU_KERNELS = EagerKernels(swiglu_forward, swiglu_backward)
SWIGLU_COMPILE_MIN_ELEMENTS = 1 << 16  # fewer: the eager kernels (the compile would cost more than it saves)


class _LowPrecisionSwiGLU(torch.autograd.Function):
    """silu(gate) * up of bf16 (fp16) rows in one pass each way (`swiglu_forward`, `swiglu_backward`), compiled on
    cpu for large inputs, where autograd of the eager ops makes six passes and a concatenation, each rounding to
    bf16; only the [gate | up] rows are kept for the backward."""

    @staticmethod
    def forward(ctx, gu_PJ):
        kernels = SWIGLU_KERNELS if gu_PJ.device.type == "cpu" and gu_PJ.numel() >= SWIGLU_COMPILE_MIN_ELEMENTS \
            else EAGER_SWIGLU_KERNELS
        ctx.save_for_backward(gu_PJ)
        ctx.kernels = kernels
        return kernels.forward(gu_PJ)

    @staticmethod
    def backward(ctx, g_PI):
        (gu_PJ,) = ctx.saved_tensors
        return ctx.kernels.backward(g_PI.contiguous(), gu_PJ)


def swiglu(gu_PJ: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of rows [gate | up]: `_LowPrecisionSwiGLU` in bf16 and fp16, the eager ops otherwise (fp32
    keeps their values bit for bit)."""
    if gu_PJ.dtype in (torch.bfloat16, torch.float16):
        return _LowPrecisionSwiGLU.apply(gu_PJ)
    gate, up = gu_PJ.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_swiglu(x_RH: torch.Tensor, expert_R: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   multiple: int = 1, params: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Row r through SwiGLU expert `expert_R[r]`: two grouped multiplies over every expert of the stacks, in the
    dtype of `gate_up` and `down` (x is cast to it). `multiple`: each expert's rows padded to a multiple of it.
    `params`: the fp32 parameters the stacks were cast from (without autograd), which receive their gradients
    (in place where they have gradient buffers); without it the gradients flow to `gate_up` and `down`."""
    layout = GroupedRows.of(expert_R, gate_up.shape[0], multiple)
    dtype = gate_up.dtype
    p_gu, p_d = params if params is not None else (None, None)
    x_PH = _ScatterRows.apply(x_RH.to(dtype), layout.dest_R, layout.rows)
    y_PH = _grouped_linear(swiglu(_grouped_linear(x_PH, gate_up, layout.offs_E, p_gu)), down, layout.offs_E, p_d)
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
            y = F.linear(swiglu(F.linear(r, gate_up[e])), down[e])
            ys.append(y if y.shape[0] == n else y[:n])  # zero rows in, their outputs dropped: no gradient
    return permute_rows(torch.cat(ys), inverse, order)
