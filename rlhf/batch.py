"""The token batch that crosses from the driver to the trainer and reference roles.

Rollouts arrive as (prompt ids, response ids, engine logprobs) per sample; the trainer wants padded
tensors. Position t of every `[B, T-1]` tensor is the prediction of token t + 1 (the layout of
`rlhf.parallel.trainer.token_logprobs`), and `mask` marks the positions that predict response tokens.

Legend: B samples, T tokens (prompt + response, right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from rlhf.micro_batches import balance
from rlhf.moe.routing import ROUTE_DTYPE, RouteShare, Routing

PER_TOKEN = ("old_logp", "ref_logp", "rollout_logp")


@dataclass(frozen=True)
class MicroBatch:
    """What one forward of the trainer takes: a padded slice of the batch and the per-sample tensors its
    loss needs (`extras`: rows, mask, advantages, old / ref / rollout logprobs)."""

    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    extras: dict
    routes_BTLk: Optional[torch.Tensor] = None  # the engine's expert choices (-1: none), [B, T, MoE layers, k]
    routing: Optional[Routing] = None  # what this forward forces and records (set by the trainer)


@dataclass(frozen=True)
class TokenBatch:
    input_ids_BT: torch.Tensor
    attention_mask_BT: torch.Tensor
    mask_BT: torch.Tensor  # [B, T-1], 1 where the position predicts a response token
    advantages_B: Optional[torch.Tensor] = None
    old_logp_BT: Optional[torch.Tensor] = None  # the sampling policy's logprobs, as the trainer computes them
    ref_logp_BT: Optional[torch.Tensor] = None
    rollout_logp_BT: Optional[torch.Tensor] = None  # the engine's own logprobs of the sampled tokens
    temperature: float = 1.0  # the rollout sampled from softmax(logits / temperature); logprobs score that
    # The engine's top-k experts per token and MoE layer (int16, -1 where it routed nothing: padding, each
    # sequence's last token), when the rollout captured them (rollout.capture_routes)
    routes_BTLk: Optional[torch.Tensor] = None
    # On a trainer rank, its share of them instead (sent apart from the batch: `rlhf.driver.run.Run.route_shares`)
    route_share: Optional[RouteShare] = None
    # The attention term of each sample's predicted cost per squared token (`rlhf.micro_batches.sample_cost`): samples
    # are spread over DP ranks by tokens plus it (0: by tokens alone). The driver sets it from the model's shape.
    attention_cost: float = 0.0

    @staticmethod
    def from_samples(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     rollout_logp: Sequence[Sequence[float]] | None = None, pad_id: int = 0,
                     temperature: float = 1.0, routes: Sequence | None = None,
                     loss_masks: Sequence[Sequence[int]] | None = None) -> "TokenBatch":
        """`routes`: per sample, the engine's expert choices [tokens routed, MoE layers, k] (numpy or torch
        integers) for its first tokens (prompt and response; the last token is never routed). `loss_masks`: per
        sample, 1 or 0 for each response token (a multi-turn episode's: 0 on the environment's observation
        tokens, which the policy read but did not sample); default all 1."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if loss_masks is not None and [len(m) for m in loss_masks] != [len(r) for r in responses]:
            raise ValueError("loss_masks: one 0/1 entry per response token of every sample")
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
        B, T = len(seqs), max(map(len, seqs))
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        attn = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T - 1)
        lp = torch.zeros(B, T - 1) if rollout_logp is not None else None
        for i, (p, s) in enumerate(zip(prompts, seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            mask[i, len(p) - 1:len(s) - 1] = 1 if loss_masks is None else torch.tensor(loss_masks[i], dtype=mask.dtype)
            if lp is not None:
                lp[i, len(p) - 1:len(s) - 1] = torch.tensor(rollout_logp[i], dtype=torch.float32)
        return TokenBatch(ids, attn, mask, rollout_logp_BT=lp, temperature=temperature,
                          routes_BTLk=None if routes is None else _pad_routes(routes, T))

    def __len__(self) -> int:
        return self.input_ids_BT.shape[0]

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask_BT.sum(1).tolist()

    @property
    def response_tokens(self) -> int:
        return int(self.mask_BT.sum())

    def response_rows(self, values_BT: torch.Tensor) -> list[list[float]]:
        """Each sample's values at its response tokens (where `mask_BT` is 1), in order: JSON-able, and
        `response_matrix` of a batch of the same samples, however padded, puts them back exactly."""
        m = self.mask_BT.bool()
        return [values_BT[i][m[i]].float().tolist() for i in range(len(self))]

    def response_matrix(self, rows: Sequence[Sequence[float]]) -> torch.Tensor:
        """[B, T-1]: `rows` (one per sample, `response_rows`) at the response tokens, 0 elsewhere."""
        out = torch.zeros_like(self.mask_BT)
        m = self.mask_BT.bool()
        for i, r in enumerate(rows):
            if len(r) != int(m[i].sum()):
                raise ValueError(f"sample {i}: {len(r)} values for {int(m[i].sum())} response tokens")
            out[i][m[i]] = torch.tensor(r, dtype=out.dtype)
        return out

    def with_(self, **fields) -> "TokenBatch":
        return replace(self, **fields)

    def dp_rows(self, row_lists: Sequence[Sequence[int]], dp: int, dp_index: int, max_tokens: int) -> list[int]:
        """The samples DP rank `dp_index` takes in any of the calls over `row_lists` (each call's rows, as given
        to `micro_batches`): what that rank needs of the per-sample data sent apart (routes)."""
        out: set[int] = set()
        for rows in row_lists:
            rows = list(rows)
            for mb in balance([self.lengths[r] for r in rows], dp, max_tokens, self.attention_cost).per_rank[dp_index]:
                out.update(rows[i] for i in mb)
        return sorted(out)

    def micro_batches(self, rows: Sequence[int], dp: int, dp_index: int, max_tokens: int) -> list[MicroBatch]:
        """This DP rank's micro-batches of the samples `rows`, balanced by token count across the `dp`
        ranks (every rank computes the same assignment). Each is trimmed to its longest sample."""
        lengths = [self.lengths[r] for r in rows]
        mine = balance(lengths, dp, max_tokens, self.attention_cost).per_rank[dp_index]
        out = []
        for mb in mine:
            idx = torch.tensor([rows[i] for i in mb])
            T = max(lengths[i] for i in mb)
            extras = {"rows": idx, "mask": self.mask_BT[idx, :T - 1]}
            if self.advantages_B is not None:
                extras["advantages"] = self.advantages_B[idx]
            for name in PER_TOKEN:
                t = getattr(self, f"{name}_BT")
                if t is not None:
                    extras[name] = t[idx, :T - 1]
            routes = (self.routes_BTLk[idx, :T] if self.routes_BTLk is not None
                      else self.route_share.rows_BTLk(idx, T) if self.route_share is not None else None)
            out.append(MicroBatch(self.input_ids_BT[idx, :T], self.attention_mask_BT[idx, :T], extras, routes))
        return out


def _pad_routes(routes: Sequence, T: int) -> torch.Tensor:
    out = torch.full((len(routes), T, *tuple(routes[0].shape)[1:]), -1, dtype=ROUTE_DTYPE)
    for i, r in enumerate(routes):  # a copy: arrays from Ray's object store are read-only
        out[i, :r.shape[0]] = torch.tensor(r).to(ROUTE_DTYPE)
    return out
