"""StaleSync's bound, pure: when producers may start a batch, which samples a step may train on, and the
statistics a step logs about the samples' age and their importance weights.

Versions: the weights after step t are version t (the initial policy is version 0); the engines serve
version v once weight sync v has completed on every engine. Step t trains on batch t. A sample made by
version w and trained on at step t is `t - 1 - w` versions stale: always 0 in the synchronous loop, which
makes batch t with version t - 1 and syncs before the next batch starts.

Legend: B samples, T response tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where the weights are computed: the queue's shards (actors) never load it
    import torch


def staleness(step: int, version: int) -> int:
    """Versions between the weights that made a sample and those step `step` starts from."""
    return step - 1 - version


def may_start(batch: int, served_version: int, max_staleness: int) -> bool:
    """Producers start batch `batch` only once the engines serve version `batch - 1 - max_staleness` or
    later. Every sample of the batch is then at most `max_staleness` stale when step `batch` trains on it,
    whatever order its groups finish in, and at most `max_staleness + 1` batches are ever made ahead of the
    trainer: the back-pressure that keeps the queue bounded."""
    return served_version >= batch - 1 - max_staleness


def admissible(step: int, version: int, max_staleness: int) -> bool:
    """Whether step `step` may train on a sample of weights `version` (never a sample from the future)."""
    return 0 <= staleness(step, version) <= max_staleness


def staleness_stats(step: int, versions_B: list[int]) -> dict[str, float]:
    """Per step: mean and max staleness of its samples, the share made by the weights it starts from, and
    how many samples have each staleness (`stale/samples_at_<k>`)."""
    ages = [staleness(step, v) for v in versions_B]
    out = {"stale/staleness_mean": sum(ages) / len(ages), "stale/staleness_max": max(ages),
           "stale/fresh_fraction": ages.count(0) / len(ages)}
    out |= {f"stale/samples_at_{k}": ages.count(k) for k in sorted(set(ages))}
    return out


def importance_stats(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                     cap: float) -> dict[str, float]:
    """The behaviour weights pi_proximal / pi_behaviour of the decoupled objective over the response tokens
    (old_logp: the trainer's logprobs at the start of the update; rollout_logp: the engine's, of the
    weights that sampled): mean, max, 99th percentile and the share truncated at `cap`."""
    import torch

    w = torch.exp(old_logp_BT.double() - rollout_logp_BT.double())[mask_BT.bool()]
    if w.numel() == 0:
        return {}
    out = {"stale/is_weight_mean": float(w.mean()), "stale/is_weight_max": float(w.max()),
           "stale/is_weight_p99": float(w.kthvalue(max(1, math.ceil(0.99 * w.numel()))).values)}
    if cap > 0:
        out["stale/is_truncated_fraction"] = float((w > cap).double().mean())
    return out
