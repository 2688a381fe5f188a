"""Sharded data parallelism (ZeRO-3, FSDP2's layout) on explicit collectives.

With `trainer.zero_stage: 3` a rank keeps only its row shard of every parameter that has identical
copies on several ranks (`rlhf.sharding.trainer.zero3_axis`: the DP group, or the expert replicas for
routed experts). Each unit (an embedding, a decoder layer's norms, attention and MLP/MoE block, the
final norm, lm_head) gathers its full parameters when its forward starts and drops them when it ends:

- forward: one all-gather per unit and group of the unit's padded row shards, flattened together;
  the module code then sees plain full tensors under the usual attribute names;
- backward: the same op's backward reduce-scatters (sums) the full gradients, so each rank receives
  the gradient of its own rows already summed over the group: DP gradient sync and sharding in one
  collective, accumulated over micro-batches by autograd;
- autograd keeps the gathered tensors it needs until the unit's backward (FSDP2's
  `reshard_after_forward=False`); with `trainer.recompute` for the unit's kind the gather runs inside
  the recomputed region, so the full parameters are freed after forward and gathered again in backward.

Why explicit collectives rather than `torch.distributed.fsdp.fully_shard`: the rest of the trainer is
explicit collectives on plain tensors (TP f/g ops, EP all-to-all, ZeRO-1 AdamW, offload by `.data`,
shard export by box); FSDP2 would make every parameter a DTensor and own the gradient reduction, and
its per-parameter dim-0 sharding is what this module does anyway. The shards stay plain
`nn.Parameter`s, so AdamW, grad clipping, offload/onload, checkpoints and the shard export are the
same code as for ZeRO-1. The shards are registered on their modules as `<name>_shard`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from rlhf.parallel.comm import all_gather_single, reduce_scatter_single
from rlhf.sharding.trainer import shard_rows


_UNIT = re.compile(r"^(model\.layers\.\d+\.[^.]+)\.")


@dataclass(frozen=True)
class RowShard:
    """One parameter's row shard: its full (TP/EP-local) shape and this rank's rows."""

    full_shape: tuple[int, ...]
    n: int  # group size
    index: int  # this rank's position in the group

    @property
    def chunk(self) -> int:
        return -(-self.full_shape[0] // self.n)

    @property
    def rest(self) -> int:
        r = 1
        for s in self.full_shape[1:]:
            r *= s
        return r

    @property
    def rows(self) -> tuple[int, int]:
        return shard_rows(self.full_shape[0], self.n, self.index)


class _GatherRows(torch.autograd.Function):
    """Row shards -> full tensors (all-gather); backward: full gradients -> shard gradients summed
    over the group (reduce-scatter)."""

    @staticmethod
    def forward(ctx, group, metas: tuple[RowShard, ...], *shards):
        ctx.group, ctx.metas = group, metas
        n = metas[0].n
        sizes = [m.chunk * m.rest for m in metas]
        flat = shards[0].new_zeros(sum(sizes))
        off = 0
        for s, size in zip(shards, sizes):
            flat[off:off + s.numel()] = s.reshape(-1)
            off += size
        out = flat.new_empty(n * flat.numel())
        all_gather_single(out, flat, group=group)
        out = out.view(n, -1)
        fulls, off = [], 0
        for m, size in zip(metas, sizes):
            fulls.append(out[:, off:off + size].reshape((n * m.chunk,) + m.full_shape[1:])[:m.full_shape[0]])
            off += size
        return tuple(fulls)

    @staticmethod
    def backward(ctx, *grads):
        metas = ctx.metas
        n = metas[0].n
        sizes = [m.chunk * m.rest for m in metas]
        ref = next(g for g in grads if g is not None)
        flat = ref.new_zeros(n, sum(sizes))
        off = 0
        for g, m, size in zip(grads, metas, sizes):
            if g is not None:
                padded = g.new_zeros((n * m.chunk,) + m.full_shape[1:])
                padded[:m.full_shape[0]] = g
                flat[:, off:off + size] = padded.view(n, size)
            off += size
        mine = flat.new_empty(sum(sizes))
        reduce_scatter_single(mine, flat.view(-1), group=ctx.group)
        out, off = [], 0
        for m, size in zip(metas, sizes):
            lo, hi = m.rows
            out.append(mine[off:off + (hi - lo) * m.rest].view((hi - lo,) + m.full_shape[1:]))
            off += size
        return (None, None, *out)


def unit_of(name: str) -> str:
    """The module whose forward gathers parameter `name`: a decoder layer's child (norm, attention,
    MLP/MoE block), else the parameter's own module (embedding, final norm, lm_head)."""
    m = _UNIT.match(name)
    return m.group(1) if m else name.rsplit(".", 1)[0]


def shard_parameters(model: nn.Module, metas: dict[str, RowShard], groups: dict[str, object],
                     axis_of: dict[str, str]) -> dict[str, nn.Parameter]:
    """Turn the named parameters (already row shards, as loaded) into gathered-on-use ones. `groups`:
    axis -> process group; `axis_of`: name -> axis. Returns name -> shard parameter. Parameters that
    several names share (tied embeddings) are gathered by each unit that uses them."""
    shards: dict[str, nn.Parameter] = {}
    users: dict[str, list[tuple[str, nn.Module, str, str]]] = {}  # unit -> (axis, owner, attribute, name)
    by_id = {id(p): n for n, p in model.named_parameters() if n in metas}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical = by_id.get(id(p))
        if canonical is None:
            continue
        owner_name, leaf = name.rsplit(".", 1)
        owner = model.get_submodule(owner_name)
        users.setdefault(unit_of(name), []).append((axis_of[canonical], owner, leaf, canonical))
        shards[canonical] = p
    for unit_name, uses in users.items():
        for _, owner, leaf, canonical in uses:
            if leaf in owner._parameters:
                del owner._parameters[leaf]
                owner.register_parameter(f"{leaf}_shard", shards[canonical])
        _wrap_forward(model.get_submodule(unit_name), uses, metas, shards, groups)
    return shards


def _wrap_forward(unit: nn.Module, uses, metas, shards, groups) -> None:
    by_axis: dict[str, list] = {}
    for axis, owner, leaf, canonical in uses:
        by_axis.setdefault(axis, []).append((owner, leaf, canonical))
    inner = unit.forward

    def forward(*args, **kwargs):
        placed = []
        for axis, items in by_axis.items():
            fulls = _GatherRows.apply(groups[axis], tuple(metas[c] for _, _, c in items),
                                      *(shards[c] for _, _, c in items))
            for (owner, leaf, _), full in zip(items, fulls):
                object.__setattr__(owner, leaf, full)
                placed.append((owner, leaf))
        try:
            return inner(*args, **kwargs)
        finally:  # the module holds no full tensor between uses; autograd keeps what backward needs
            for owner, leaf in placed:
                owner.__dict__.pop(leaf, None)

    unit.forward = forward
