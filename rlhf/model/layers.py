"""Building blocks both decoder families share."""

from __future__ import annotations

import torch
from torch import nn


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


def full_precision_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in the operands' own dtype even under autocast: MoE routers choose experts in the parameters'
    precision (a bf16 router flips near-tied choices; Megatron keeps its routers in fp32 likewise)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x, weight)
