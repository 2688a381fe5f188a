"""Policy losses and KL estimators. Pure.

Names are one per quantity across the codebase: `logp` (current policy), `old_logp` (the policy that
sampled, as the trainer recomputes it), `rollout_logp` (the engine's own logprobs), `ref_logp`
(reference policy), `advantages`, `mask` (response tokens). Legend: B samples, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.schema import KLEstimator, LossAggregation


@dataclass(frozen=True)
class LossStats:
    loss: torch.Tensor  # scalar, differentiable
    clip_fraction: float  # share of tokens whose ratio was clipped
    ratio_mean: float


def aggregate(x_BT: torch.Tensor, mask_BT: torch.Tensor, how: LossAggregation,
              normaliser: float | None = None) -> torch.Tensor:
    """Token-mean over the batch (DAPO), mean over sequences of token means (GRPO paper), or mean over
    sequences of token sums. `normaliser` replaces the local token count (global counts across
    micro-batches and DP ranks)."""
    mask = mask_BT.to(x_BT.dtype)
    if how is LossAggregation.token_mean:
        return (x_BT * mask).sum() / (normaliser if normaliser is not None else mask.sum().clamp(min=1))
    per_seq = (x_BT * mask).sum(1)
    if how is LossAggregation.seq_mean_token_mean:
        per_seq = per_seq / mask.sum(1).clamp(min=1)
    return per_seq.sum() / (normaliser if normaliser is not None else x_BT.shape[0])


def ppo_clip_loss(logp_BT, old_logp_BT, advantages_B, mask_BT, clip_low: float, clip_high: float,
                  how: LossAggregation = LossAggregation.token_mean, normaliser: float | None = None,
                  tis_weight_BT: torch.Tensor | None = None) -> LossStats:
    """PPO clipped surrogate with separate low / high epsilons (DAPO's clip-higher):
    -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A), optionally times truncated IS weights."""
    ratio = torch.exp(logp_BT - old_logp_BT)
    adv = advantages_B[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if tis_weight_BT is not None:
        per_token = per_token * tis_weight_BT
    m = mask_BT.bool()
    with torch.no_grad():
        was_clipped = (clipped < unclipped)[m].float()
        clip_fraction = float(was_clipped.mean()) if was_clipped.numel() else 0.0
        ratio_mean = float(ratio[m].mean()) if m.any() else 1.0
    return LossStats(aggregate(per_token, mask_BT, how, normaliser), clip_fraction, ratio_mean)


def gspo_loss(logp_BT, old_logp_BT, advantages_B, mask_BT, clip_low: float, clip_high: float,
              normaliser: float | None = None) -> LossStats:
    """GSPO: one ratio per sequence, exp(mean over its tokens of logp - old_logp), clipped like PPO."""
    mask = mask_BT.to(logp_BT.dtype)
    log_ratio_B = ((logp_BT - old_logp_BT) * mask).sum(1) / mask.sum(1).clamp(min=1)
    ratio_B = torch.exp(log_ratio_B)
    unclipped = ratio_B * advantages_B
    clipped = ratio_B.clamp(1 - clip_low, 1 + clip_high) * advantages_B
    per_seq = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clip_fraction = float((clipped < unclipped).float().mean())
    loss = per_seq.sum() / (normaliser if normaliser is not None else per_seq.shape[0])
    return LossStats(loss, clip_fraction, float(ratio_B.detach().mean()))


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled tokens: k1 = log r, k3 = r - 1 - log r
    with r = ref / policy (Schulman's low-variance, always >= 0 estimator)."""
    log_r = ref_logp_BT - logp_BT
    if estimator is KLEstimator.k1:
        return -log_r
    return torch.exp(log_r) - 1 - log_r


def truncated_is_weights(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling for the rollout / trainer mismatch: min(pi_old / pi_rollout, cap),
    no gradient."""
    return torch.exp(old_logp_BT - rollout_logp_BT).clamp(max=cap).detach()
