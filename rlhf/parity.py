"""Trainer/engine logprob parity: how far the trainer's logprobs of sampled tokens are from the
engine's. Cheap (it reuses logprobs both sides compute anyway) and logged every step, so a MoE
mismatch (a stale or mis-installed weight, a kernel difference) shows up at once, not weeks later.

Legend: B samples, T response tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Parity:
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    p99_abs_diff: float = 0.0  # the 99th percentile: what a broken or stale sync moves, one near-tie does not


def parity_problem(parity: Parity, p99_limit: float) -> str | None:
    """Why a step's parity says the engine does not hold the trainer's weights, or None. Judged on the 99th
    percentile: a stale or mis-installed weight moves most tokens' logprobs, while a router near-tie that
    picks another expert on one side (kernel rounding) moves one token by up to 1e-2 on a healthy run; the
    max is reported beside it, never judged alone."""
    if parity.tokens and parity.p99_abs_diff > p99_limit:
        return (f"trainer/engine logprob difference p99 {parity.p99_abs_diff:.2e} over {parity.tokens} tokens exceeds "
                f"rollout.parity_p99_max={p99_limit:g} (mean {parity.mean_abs_diff:.2e}, max "
                f"{parity.max_abs_diff:.2e}): the engine may not hold the trainer's weights")
    return None


def run_parity_limit(cfg) -> float:
    """A run's limit (`RunConfig`): rollout.parity_p99_max if set, else by the engines' dtype and the trainer's
    compute dtype: both fp32 1e-3; bf16 rounding on one side 0.5 (the tiny job: 0.08-0.44); on both 1.0 (the
    tiny job: up to 0.63 in 350 steps, docs/trainer.md)."""
    from rlhf.schema import DType

    trainer = cfg.trainer.compute_dtype or cfg.model.dtype
    if cfg.rollout.parity_p99_max > 0 or trainer is DType.float32:
        return cfg.rollout.parity_limit
    return 0.5 if cfg.rollout.dtype is DType.float32 else 1.0


def logprob_parity(trainer_logp_BT: torch.Tensor, engine_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> Parity:
    """Max, mean and 99th percentile of |trainer - engine| over the tokens where mask is set."""
    if trainer_logp_BT.shape != engine_logp_BT.shape or mask_BT.shape != trainer_logp_BT.shape:
        raise ValueError(f"shapes differ: trainer {tuple(trainer_logp_BT.shape)}, engine "
                         f"{tuple(engine_logp_BT.shape)}, mask {tuple(mask_BT.shape)}")
    diff = (trainer_logp_BT.double() - engine_logp_BT.double()).abs()[mask_BT.bool()]
    if diff.numel() == 0:
        return Parity(0.0, 0.0, 0)
    p99 = float(diff.kthvalue(max(1, math.ceil(0.99 * diff.numel()))).values)  # quantile() refuses > 16M values
    return Parity(float(diff.max()), float(diff.mean()), int(diff.numel()), p99)
