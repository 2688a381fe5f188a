"""Building blocks both decoder families share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype matmuls compute in under an enabled `torch.autocast` for this device type, or None (the
    trainer's `trainer.compute_dtype`: fp32 parameters, bf16 matmuls)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inv` with inv[order[i]] = i (argsort of a permutation, without the sort)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """`x[order]` for a permutation `order` of x's rows (`inverse` its inverse, if at hand). The same values and
    gradients as indexing, whose backward zero-fills a gradient of x's size and adds into it with an
    index_put; a permutation's gradient is a gather by the inverse (index_put, fill and index held up to 0.7 s of
    an 8.8 s bf16 update step's profile, `python -m benchmarks.update_profile --ranks 2 --compute-dtype bfloat16`)."""
    return _PermuteRows.apply(x, order, inverse_permutation(order) if inverse is None else inverse)


SHORT_SEQUENCE = 256  # tokens: up to here a bf16 training forward on cpu takes SDPA's math path (`attention`)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, **kw) -> torch.Tensor:
    """`F.scaled_dot_product_attention`. A bf16 forward on cpu that records for a backward over short sequences
    takes the math path: torch's cpu flash kernel is the faster forward, but its backward is slow on short
    sequences (forward and backward at 136 tokens, 7 sequences, 8 heads: 25-34 ms flash, 15-16 ms math; at 512
    tokens the flash kernel wins in bf16, and in fp32 it wins at 136 tokens too: `python -m benchmarks.cpu_kernels`)."""
    dtype = autocast_dtype(q.device.type) or q.dtype  # SDPA computes in autocast's dtype
    if (q.device.type == "cpu" and dtype is torch.bfloat16 and q.shape[-2] <= SHORT_SEQUENCE
            and torch.is_grad_enabled() and q.requires_grad):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def full_precision_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in the operands' own dtype even under autocast: MoE routers choose experts in the parameters'
    precision (a bf16 router flips near-tied choices; Megatron keeps its routers in fp32 likewise)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x, weight)
