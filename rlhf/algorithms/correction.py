"""Rollout correction: the engines' policy is not the trained one (another kernel, another precision, FP8
weights: docs/quantized_rollout.md), so the loss reweights or drops what they sampled. Pure.

With r_t = pi_train(y_t) / pi_rollout(y_t) for each response token (pi_train: the trainer's logprobs at the
update's start, `old_logp`; pi_rollout: the engine's own logprobs of the token it sampled), the suite
(`AlgorithmConfig`; any of them together, their weights multiply):

  tis_cap       token-level truncated IS: each token weighted by min(r_t, cap)
  seq_mis_cap   sequence-level masked IS: each sequence weighted by its ratio R = prod_t r_t when
                1 / cap <= R <= cap, and dropped (weight 0) otherwise
  geo_rs_cap    geometric-mean rejection: a sequence whose per-token geometric mean G = exp(mean_t log r_t)
                lies outside [1 / cap, cap] is dropped; the rest keep weight 1
  veto_threshold  a sequence holding any token with r_t < threshold is dropped (one token the trainer finds
                far less likely than the engine did: a sign the sample is not the trained policy's)

When to use which is in docs/quantized_rollout.md. verl's rollout correction and slime's ship the same
estimators. `correction_stats` gives the metrics a step logs from the same weights the loss uses.

Legend: B samples, T tokens.
"""

from __future__ import annotations

import math

import torch

from rlhf.algorithms.losses import truncated_is_weights
from rlhf.schema import AlgorithmConfig


def corrects(cfg: AlgorithmConfig) -> bool:
    """Whether any estimator of the suite is on."""
    return cfg.tis_cap > 0 or cfg.seq_mis_cap > 0 or cfg.geo_rs_cap > 0 or cfg.veto_threshold > 0


def _log_ratio(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """log r_t on response tokens, 0 elsewhere (float64: a sequence's sum of hundreds of them stays exact
    enough to compare with a cap)."""
    return torch.where(mask_BT > 0, old_logp_BT.double() - rollout_logp_BT.double(), 0.0)


@torch.no_grad()
def correction_parts(cfg: AlgorithmConfig, old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each estimator's effect: `token` [B, T] (TIS weights), `sequence` [B] (MIS weights), `rejected` [B]
    (geometric-mean rejection), `vetoed` [B], and their product `weight` [B, T] (float32, no gradient)."""
    log_r = _log_ratio(old_logp_BT, rollout_logp_BT, mask_BT)
    m = mask_BT > 0
    n_B = m.sum(1)
    weight = torch.ones_like(log_r)
    out: dict[str, torch.Tensor] = {}
    if cfg.tis_cap > 0:  # the loss's token TIS as it always was (float32), so TIS alone weighs what it did
        out["token"] = torch.where(m, truncated_is_weights(old_logp_BT, rollout_logp_BT, cfg.tis_cap), 1.0)
        weight = weight * out["token"]
    if cfg.seq_mis_cap > 0:
        seq_log = log_r.sum(1)
        bound = math.log(cfg.seq_mis_cap)
        inside = (seq_log <= bound) & (seq_log >= -bound)
        out["masked"] = ~inside
        out["sequence"] = torch.where(inside, torch.exp(seq_log.clamp(-bound, bound)), 0.0)
        weight = weight * out["sequence"][:, None]
    if cfg.geo_rs_cap > 0:
        geo_log = log_r.sum(1) / n_B.clamp(min=1)
        bound = math.log(cfg.geo_rs_cap)
        out["rejected"] = (geo_log > bound) | (geo_log < -bound)
        weight = weight * (~out["rejected"]).double()[:, None]
    if cfg.veto_threshold > 0:
        out["vetoed"] = ((log_r < math.log(cfg.veto_threshold)) & m).any(1)
        weight = weight * (~out["vetoed"]).double()[:, None]
    out["weight"] = weight.float()
    return out


def correction_weights(cfg: AlgorithmConfig, old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> torch.Tensor | None:
    """The loss's per-token weights [B, T] of the suite, or None when no estimator is on."""
    if not corrects(cfg):
        return None
    return correction_parts(cfg, old_logp_BT, rollout_logp_BT, mask_BT)["weight"]


@torch.no_grad()
def correction_stats(cfg: AlgorithmConfig, old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> dict[str, float]:
    """A step's `correction/*` metrics: the train-minus-rollout logprob difference over response tokens (mean
    and 99th percentile of its magnitude, logged whether or not a correction is on: without one it shows why
    one is needed) and, per estimator on, the share of tokens clipped or of sequences masked, rejected or
    vetoed, and the mean weight a response token gets."""
    m = mask_BT > 0
    if not bool(m.any()):
        return {}
    diff = (old_logp_BT.double() - rollout_logp_BT.double())[m]
    mag = diff.abs()
    out = {"correction/logp_diff_mean": float(diff.mean()),
           "correction/logp_diff_abs_p99": float(mag.kthvalue(max(1, math.ceil(0.99 * mag.numel()))).values),
           "correction/seq_ratio_log_abs_max": float(_log_ratio(old_logp_BT, rollout_logp_BT, mask_BT).sum(1).abs().max())}
    if not corrects(cfg):
        return out
    parts = correction_parts(cfg, old_logp_BT, rollout_logp_BT, mask_BT)
    if "token" in parts:
        out["correction/token_clipped_fraction"] = float((torch.exp(diff) > cfg.tis_cap).double().mean())
    if "masked" in parts:
        out["correction/seq_masked_fraction"] = float(parts["masked"].double().mean())
    if "rejected" in parts:
        out["correction/seq_rejected_fraction"] = float(parts["rejected"].double().mean())
    if "vetoed" in parts:
        out["correction/seq_vetoed_fraction"] = float(parts["vetoed"].double().mean())
    out["correction/weight_mean"] = float(parts["weight"][m].double().mean())
    return out
