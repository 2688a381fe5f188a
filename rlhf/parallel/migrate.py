"""Expert migration in the parallel trainer (EDPB, `ParallelTrainer.migrate_experts`): the experts that change
EP shard travel, each as one row (its gate_up and down weights, each followed by its two AdamW moments), in
one all-to-all over the EP group. ZeRO-1 moment slices are gathered over the bucket's ranks first, ZeRO-3 row
shards over the expert replicas, and both are split again after, so each rank ends holding exactly what a
trainer started with the new maps would hold, with the optimizer state the old placement had built.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhf.sharding.trainer import shard_rows
from rlhf.parallel.comm import all_to_all


def move_experts(tr, old, new, layers: Sequence[int]) -> int:
    """The all-to-all of `migrate_experts`; returns the bytes this rank sent. A moving expert travels as one
    row: its gate_up and down weights, each followed by its two AdamW moments."""
    E, ep, me = tr.cfg.num_experts, tr.layout.expert_shards, tr.layout.ep_index(tr.rank)
    pairs = {j: tuple(f"model.layers.{j + tr.cfg.first_k_dense_layers}.mlp.experts.{w}"
                      for w in ("gate_up_proj", "down_proj")) for j in layers}
    params = {n: tr.params[n] for pair in pairs.values() for n in pair}
    moments = tr.optimizer.full_moments({id(p) for p in params.values()})
    # each tensor's whole local stack [E / ep, ...]: the weights, exp_avg, exp_avg_sq
    stacks = {n: [_whole_rows(tr, n, t) for t in (p.detach(), *moments[id(p)])] for n, p in params.items()}
    held = {j: [e for e in range(E) if old[j][e] == me] for j in layers}  # stacking order: by expert id

    def moving(src: int, dst: int):  # the (layer, expert) pairs going src -> dst, in the order they travel
        return [(j, e) for j in layers for e in range(E) if old[j][e] == src and new[j][e] == dst]

    rows, send = [], [0] * ep
    for dst in range(ep):
        for j, e in moving(me, dst) if dst != me else ():
            i = held[j].index(e)
            rows.append(torch.cat([t[i].reshape(-1) for n in pairs[j] for t in stacks[n]]))
            send[dst] += 1
    recv = [len(moving(src, me)) if src != me else 0 for src in range(ep)]
    width = 3 * sum(stacks[n][0][0].numel() for n in pairs[layers[0]])
    outgoing = torch.stack(rows) if rows else next(iter(params.values())).new_zeros(0, width)
    with torch.no_grad():
        incoming = all_to_all(outgoing, send, recv, tr.groups.ep)
    arrived = dict(zip([je for src in range(ep) if src != me for je in moving(src, me)], incoming))
    for j in layers:
        offset = 0
        for n in pairs[j]:
            p, size = params[n], stacks[n][0][0].numel()
            for which, target in enumerate((p, *moments[id(p)])):
                stack = stacks[n][which]
                parts = [stack[held[j].index(e)] if old[j][e] == me else
                         arrived[j, e][offset + which * size:offset + (which + 1) * size].view_as(stack[0])
                         for e in range(E) if new[j][e] == me]
                with torch.no_grad():
                    target.copy_(_my_rows(tr, n, torch.stack(parts)))
            offset += 3 * size
            p.grad = None  # of the old placement; the next step starts from zeros
    tr.optimizer.keep_moments(moments)
    return outgoing.numel() * outgoing.element_size()

def _whole_rows(tr, name: str, t: torch.Tensor) -> torch.Tensor:
    """A ZeRO-3 row shard gathered over its group into the whole local stack; other tensors as they are."""
    shard = tr.row_shards.get(name)
    if shard is None or shard.n == 1:
        return t
    padded = t.new_zeros((shard.chunk,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(shard.n)]
    torch.distributed.all_gather(parts, padded.contiguous(), group=tr.groups.expert_replica)
    return torch.cat(parts)[: shard.full_shape[0]]

def _my_rows(tr, name: str, whole: torch.Tensor) -> torch.Tensor:
    shard = tr.row_shards.get(name)
    if shard is None or shard.n == 1:
        return whole
    lo, hi = shard_rows(shard.full_shape[0], shard.n, shard.index)
    return whole[lo:hi]
