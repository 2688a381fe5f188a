"""Trainer/engine logprob parity: how far the trainer's logprobs of sampled tokens are from the
engine's. Cheap (it reuses logprobs both sides compute anyway) and logged every step, so a MoE
mismatch (a stale or mis-installed weight, a kernel difference) shows up at once, not weeks later.

Legend: B samples, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int


def logprob_parity(trainer_logp_BT: torch.Tensor, engine_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> Parity:
    """Max and mean |trainer - engine| over the tokens where mask is set."""
    if trainer_logp_BT.shape != engine_logp_BT.shape or mask_BT.shape != trainer_logp_BT.shape:
        raise ValueError(f"shapes differ: trainer {tuple(trainer_logp_BT.shape)}, engine "
                         f"{tuple(engine_logp_BT.shape)}, mask {tuple(mask_BT.shape)}")
    diff = (trainer_logp_BT.double() - engine_logp_BT.double()).abs()[mask_BT.bool()]
    if diff.numel() == 0:
        return Parity(0.0, 0.0, 0)
    return Parity(float(diff.max()), float(diff.mean()), int(diff.numel()))
