"""Micro-batches balanced by predicted cost across data-parallel ranks. Pure.

RL responses vary a lot in length, so splitting a batch by sample count leaves some DP ranks with
far more work than others. A sample's predicted cost is its tokens plus the attention term, quadratic
in its length (`sample_cost`; the coefficient from the model's shape, `rlhf.sim.workload.attention_quadratic`:
0 balances by tokens alone). Samples go to the DP rank with the least cost so far, longest first
(LPT); each rank packs its samples into micro-batches whose padded size (samples x longest sample)
stays under a token budget (first-fit decreasing). Every rank of a pipeline stage must run the same
number of micro-batches (EP all-to-alls span DP ranks), so ranks with fewer are evened out by
splitting their largest micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Balanced:
    per_rank: tuple[tuple[tuple[int, ...], ...], ...]  # [dp rank][micro-batch] -> sample indices
    tokens_per_rank: tuple[int, ...]
    cost_per_rank: tuple[float, ...] = ()  # predicted cost (`sample_cost`) per rank

    @property
    def imbalance(self) -> float:
        """Most tokens on one rank over the mean (1.0 is perfect)."""
        return _max_over_mean(self.tokens_per_rank)

    @property
    def cost_imbalance(self) -> float:
        """The slowest rank's predicted cost over the mean (1.0 is perfect)."""
        return _max_over_mean(self.cost_per_rank)


def _max_over_mean(values) -> float:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else 1.0


def sample_cost(length: int, quadratic: float = 0.0) -> float:
    """A sample's predicted work in units of one token's linear work (projections, experts, LM head): its
    tokens, plus `quadratic` per squared token for causal attention over its own positions."""
    return length + quadratic * length * length


def by_index_imbalance(lengths: Sequence[int], dp: int, quadratic: float = 0.0) -> float:
    """The slowest rank's predicted cost over the mean when sample i goes to DP rank i % dp, as a split by
    sample count does: what balancing is measured against."""
    return _max_over_mean([sum(sample_cost(lengths[i], quadratic) for i in range(r, len(lengths), dp))
                           for r in range(dp)])


def padded_cost(mb: Sequence[int], lengths: Sequence[int]) -> int:
    return len(mb) * max(lengths[i] for i in mb) if mb else 0


def balance(lengths: Sequence[int], dp: int, max_tokens: int, quadratic: float = 0.0) -> Balanced:
    """Assign samples (by predicted cost, `sample_cost(length, quadratic)`) to `dp` ranks and pack them into
    micro-batches of at most `max_tokens` padded tokens (a longer single sample gets a micro-batch of its own)."""
    if dp < 1 or max_tokens < 1:
        raise ValueError(f"dp={dp}, max_tokens={max_tokens}: both must be >= 1")
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} samples cannot feed {dp} data-parallel ranks; "
                         f"raise the batch size or lower trainer.dp")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(dp)]
    load, tokens = [0.0] * dp, [0] * dp
    for i in order:  # longest first: the costliest, the cost rising with the length
        r = min(range(dp), key=lambda r: (load[r], len(ranks[r]), r))
        ranks[r].append(i)
        load[r] += sample_cost(lengths[i], quadratic)
        tokens[r] += lengths[i]
    packed = [_pack(samples, lengths, max_tokens) for samples in ranks]
    target = max(len(p) for p in packed)
    for r, mbs in enumerate(packed):
        while len(mbs) < target:
            splittable = [m for m in mbs if len(m) > 1]
            if not splittable:
                raise ValueError(f"DP rank {r} has {sum(map(len, mbs))} samples but every rank must run {target} "
                                 f"micro-batches; raise trainer.micro_batch_tokens or the batch size")
            big = max(splittable, key=lambda m: padded_cost(m, lengths))
            mbs.remove(big)
            mbs += [big[: len(big) // 2], big[len(big) // 2:]]
    per_rank = tuple(tuple(tuple(sorted(m)) for m in sorted(mbs, key=min)) for mbs in packed)
    return Balanced(per_rank, tuple(tokens), tuple(load))


def _pack(samples: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    mbs: list[list[int]] = []
    for i in samples:  # longest first, so a micro-batch's padded width is its first sample's length
        for mb in mbs:
            if padded_cost(mb + [i], lengths) <= max_tokens:
                mb.append(i)
                break
        else:
            mbs.append([i])
    return mbs
