"""The RL objective chosen once from `AlgorithmConfig`: how rewards become advantages, and the loss of
one micro-batch. Pure; the trainer role calls `policy_loss`, the driver calls `advantages`.

  grpo          group-normalised advantages (std optional), PPO clip
  dapo          GRPO plus DAPO's options, which config validation requires (`dapo_problems`): clip-higher
                (clip_eps_high > clip_eps_low), token-mean loss, dynamic sampling (the driver keeps groups
                whose rewards differ); the overlong penalty (`overlong_buffer_tokens`) is optional
  gspo          group-normalised advantages, one clipped ratio per sequence
  reinforce_pp  group-mean baseline, batch-normalised advantages, PPO clip

KL to the reference is a loss term (`kl_coef`, k1 or k3) or, with `kl_in_reward`, a per-sequence
penalty on the reward. Truncated importance sampling (`tis_cap` > 0) reweights tokens by
min(pi_old / pi_rollout, cap) for the mismatch between the trainer's and the engine's logprobs; the rest of
the rollout-correction suite (sequence-level masked IS, geometric-mean rejection, the token veto:
`rlhf.algorithms.correction`) multiplies into the same per-token weight.

Legend: P prompts, G samples per prompt, B samples, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.algorithms.advantages import grpo_advantages, reinforce_pp_advantages
from rlhf.algorithms.correction import correction_weights, corrects
from rlhf.algorithms.losses import aggregate, gspo_loss, kl_penalty, ppo_clip_loss
from rlhf.schema import AlgorithmConfig, Estimator, LossAggregation


def advantages(cfg: AlgorithmConfig, rewards_PG: torch.Tensor) -> torch.Tensor:
    """Per-sample advantages [P * G] from rewards grouped by prompt."""
    if cfg.estimator is Estimator.reinforce_pp:
        return reinforce_pp_advantages(rewards_PG).reshape(-1)
    return grpo_advantages(rewards_PG, cfg.normalize_std).reshape(-1)


def loss_normaliser(cfg: AlgorithmConfig, mask_BT: torch.Tensor) -> float:
    """What the summed loss of a mini-batch is divided by: its response tokens for token-mean
    aggregation, its sequences otherwise (and always for GSPO's sequence-level loss)."""
    if cfg.estimator is not Estimator.gspo and cfg.loss_aggregation is LossAggregation.token_mean:
        return float(mask_BT.sum().clamp(min=1))
    return float(mask_BT.shape[0])


@dataclass
class LossRecord:
    """Sums over micro-batches, weighted by response tokens, for the step's metrics."""

    tokens: float = 0.0
    clip_fraction: float = 0.0
    ratio: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0

    def add(self, n: float, clip_fraction: float, ratio: float, kl: float, entropy: float) -> None:
        self.tokens += n
        self.clip_fraction += n * clip_fraction
        self.ratio += n * ratio
        self.kl += n * kl
        self.entropy += n * entropy


def policy_loss(cfg: AlgorithmConfig, logp_BT: torch.Tensor, entropy_BT: torch.Tensor, extras: dict,
                normaliser: float, record: LossRecord | None = None) -> torch.Tensor:
    """The loss of one micro-batch, already divided by the mini-batch's global `normaliser`, so that
    summing gradients over micro-batches and DP ranks gives the mini-batch gradient."""
    mask, adv = extras["mask"], extras["advantages"]
    # on-policy (`on_policy`): the weights that sampled are the ones this forward runs, so the ratio's
    # denominator is this very logprob, detached (ratio 1, the gradient of the clipped objective unchanged)
    old_logp = extras["old_logp"] if "old_logp" in extras else logp_BT.detach()
    if cfg.estimator is Estimator.gspo:
        stats = gspo_loss(logp_BT, old_logp, adv, mask, cfg.clip_eps_low, cfg.clip_eps_high, normaliser)
    else:
        tis = correction_weights(cfg, old_logp, extras["rollout_logp"], mask) if corrects(cfg) else None
        stats = ppo_clip_loss(logp_BT, old_logp, adv, mask, cfg.clip_eps_low, cfg.clip_eps_high,
                              cfg.loss_aggregation, normaliser, tis)
    loss = stats.loss
    kl = torch.zeros(())
    if "ref_logp" in extras:  # outside the response the reference may be absent (0: computed ahead, StaleSync):
        ref = torch.where(mask > 0, extras["ref_logp"], logp_BT.detach())  # there KL is 0, never exp overflow
        kl_BT = kl_penalty(logp_BT, ref, cfg.kl_estimator)
        kl = (kl_BT * mask).sum() / mask.sum().clamp(min=1)
        if cfg.kl_coef > 0 and not cfg.kl_in_reward:
            loss = loss + cfg.kl_coef * aggregate(kl_BT, mask, _aggregation(cfg), normaliser)
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * aggregate(entropy_BT, mask, _aggregation(cfg), normaliser)
    if record is not None:
        n = float(mask.sum())
        ent = float((entropy_BT.detach() * mask).sum() / max(n, 1.0))
        record.add(n, stats.clip_fraction, stats.ratio_mean, float(kl.detach()), ent)
    return loss


def _aggregation(cfg: AlgorithmConfig) -> LossAggregation:
    return LossAggregation.seq_mean_token_mean if cfg.estimator is Estimator.gspo else cfg.loss_aggregation


def on_policy(cfg: AlgorithmConfig, epochs: int, mini_batches: int) -> bool:
    """`AlgorithmConfig.on_policy`: then `policy_loss` takes the old logprobs from the update's own forward."""
    return cfg.on_policy(epochs, mini_batches)


def kl_reward_penalty(cfg: AlgorithmConfig, old_logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor,
                      mask_BT: torch.Tensor) -> torch.Tensor:
    """`kl_in_reward`: kl_coef times each sequence's summed KL estimate, to subtract from its reward. [B]"""
    ref_logp_BT = torch.where(mask_BT > 0, ref_logp_BT, old_logp_BT)  # 0 outside the response: see policy_loss
    return cfg.kl_coef * (kl_penalty(old_logp_BT, ref_logp_BT, cfg.kl_estimator) * mask_BT).sum(1)
