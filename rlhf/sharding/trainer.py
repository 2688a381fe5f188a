"""How the trainer shards the MoE model (Qwen3-MoE, DeepSeek-V3), declared as data; and the shard spec it implies. Pure.

One rule per parameter kind (matched on names, checkpoint or our in-memory ones): which mesh axis
splits which tensor dim. Column-parallel projections (q, MLA's q_b/kv_b, dense and shared-expert
gate/up) split dim 0 over `tp`, row-parallel ones (o_proj, down) dim 1; KV projections are split by
head, or replicated by head group when tp exceeds the KV heads; routed experts are stacked per layer
([E_local, 2I, H] gate/up and [E_local, H, I] down) and split by an expert -> shard map (EP);
everything else is replicated. Pipeline stages own contiguous layer ranges; the embedding sits on
the first stage, MTP modules, the final norm and lm_head on the last. Data-parallel ranks hold full
replicas of their stage's shards. The tables come from `rlhf.model.shapes.param_shapes`, so every
architecture the schema describes (MLA, shared experts, MTP) is covered. MLA's latent projections
(q_a, kv_a and their norms) are replicated over TP and their gradients summed over the stage; the
sigmoid router's correction bias and the MTP modules are frozen (`is_frozen`): held, saved and synced,
never stepped.

With `zero_stage=3` (sharded data parallelism, FSDP2's layout) every parameter that has identical
copies on several ranks is further split by rows (dim 0) over those ranks: the DP group for
attention, dense MLPs, norms, embedding and lm_head; the expert-replica group for routed experts (a
stacked expert buffer splits by whole experts). Router and q/k norms (gradients summed over the
whole stage, a few KB) and the sigmoid router's correction bias stay replicated. Rank i of a group of
n holds rows [i*c, min((i+1)*c, d0)), c = ceil(d0 / n): its own box of the HF tensor, so the resharding
layer sends each destination its slices straight from the rank that owns them.

`trainer_shard_spec` turns these rules into a `ShardSpec` in canonical HF names: the contract between
the parallel trainer (which loads its slices with `weight_sync.pieces`) and the resharding planner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

from rlhf.schema import ModelConfig
from rlhf.sharding.layout import Layout, check_expert_map, default_expert_map
from rlhf.model.shapes import param_shapes
from weight_sync.spec import Box, Piece, RankShards, ShardSpec

Shape = tuple[int, ...]


class Split(Enum):
    replicate = "replicate"
    tp_rows = "tp_rows"  # column parallel: dim 0 over tp
    tp_cols = "tp_cols"  # row parallel: dim 1 over tp
    tp_kv_rows = "tp_kv_rows"  # dim 0 by KV head over tp; replicated by head group when tp > KV heads
    experts = "experts"  # stacked experts: dim 0 by the expert map over the EP group


SHARDING_RULES: tuple[tuple[str, Split], ...] = (
    (r"\.self_attn\.(q|q_b|kv_b)_proj\.weight$", Split.tp_rows),
    (r"\.self_attn\.[kv]_proj\.weight$", Split.tp_kv_rows),
    (r"\.self_attn\.o_proj\.weight$", Split.tp_cols),
    (r"\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", Split.tp_rows),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", Split.tp_cols),
    (r"\.mlp\.experts\.(gate_up_proj|down_proj)$", Split.experts),  # our stacked buffers
)

# Replicated parameters whose gradient each rank only sees part of, so it is summed over the whole
# stage (dp x tp) rather than over dp alone: q/k norms act on this TP rank's heads only; the router
# sees this rank's slice of the tokens (MoE blocks split the TP group's tokens).
STAGE_REDUCED_GRADS: tuple[str, ...] = (r"\.self_attn\.[qk]_norm\.weight$", r"\.mlp\.gate\.weight$",
                                        # MLA's latent projections: replicated, each TP rank's heads use them
                                        r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm)\.weight$")

# Held, synced and saved but never stepped by the optimizer: the sigmoid router's correction bias (a balancing
# term, not a gradient-trained one) and the MTP modules (carried, not run).
FROZEN: tuple[str, ...] = (r"\.mlp\.gate\.e_score_correction_bias$",)

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def grad_reduced_over_stage(name: str) -> bool:
    return any(re.search(p, name) for p in STAGE_REDUCED_GRADS)


def frozen_by_name(name: str) -> bool:
    """Never stepped whatever layer holds it (`FROZEN`: the router's correction bias)."""
    return any(re.search(p, name) for p in FROZEN)


def is_frozen(name: str, cfg: ModelConfig) -> bool:
    """Never stepped: frozen by name, or in an MTP module (a layer past the decoder's)."""
    m = _LAYER.match(name)
    return frozen_by_name(name) or (m is not None and int(m.group(1)) >= cfg.num_hidden_layers)


def split_of(name: str) -> Split:
    for pattern, split in SHARDING_RULES:
        if re.search(pattern, name):
            return split
    return Split.replicate


def stage_of(name: str, cfg: ModelConfig, stages: Sequence[range]) -> int:
    """Embedding on the first stage; MTP modules, final norm and lm_head on the last."""
    if name.startswith("model.embed_tokens."):
        return 0
    m = _LAYER.match(name)
    if m and int(m.group(1)) < cfg.num_hidden_layers:
        return next(s for s, r in enumerate(stages) if int(m.group(1)) in r)
    return len(stages) - 1


@dataclass(frozen=True)
class TrainerSharding:
    """The shards of one trainer rank: local shape of each owned parameter and its HF pieces."""

    rank: int
    local_shapes: dict[str, Shape]
    pieces: tuple[Piece, ...]

    def buffer_shapes(self) -> dict[str, Shape]:
        return self.local_shapes


def _box(split: Split, shape: Shape, cfg: ModelConfig, t: int, tp: int) -> Box:
    K, D = cfg.num_key_value_heads, cfg.head_dim
    if split is Split.tp_rows or (split is Split.tp_kv_rows and K % tp == 0):
        rows = shape[0] // tp
        return Box((t * rows, 0), (rows, shape[1]))
    if split is Split.tp_kv_rows:  # tp > K: each rank needs the one KV head its query heads use
        return Box((t * K // tp * D, 0), (D, shape[1]))
    if split is Split.tp_cols:
        cols = shape[1] // tp
        return Box((0, t * cols), (shape[0], cols))
    return Box.full(shape)


def _stage_tables(cfg: ModelConfig, stages: Sequence[range]):
    """Per stage: its non-expert tensors (name, shape, split) and its MoE layers' expert prefixes."""
    dense: list[list[tuple[str, Shape, Split]]] = [[] for _ in stages]
    experts: list[list[str]] = [[] for _ in stages]
    for name, shape in param_shapes(cfg).items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        stage = stage_of(name, cfg, stages)
        m = _PER_EXPERT.match(name)
        if m is None:
            dense[stage].append((name, shape, split_of(name)))
        elif m.group(2) == "0" and m.group(3) == "gate":
            experts[stage].append(m.group(1))
    return dense, experts


def _rank_buffers_and_pieces(cfg, dense, expert_prefixes, t: int, tp: int, local_of: Callable[[str], Sequence[int]]):
    """Local buffers (our parameter names, which equal HF names but for stacked experts) and pieces;
    `local_of(prefix)`: the global expert ids this rank holds in that layer, in stacking order."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    buffers: dict[str, Shape] = {}
    pieces: list[Piece] = []
    for name, shape, split in dense:
        box = _box(split, shape, cfg, t, tp)
        buffers[name] = box.size
        pieces.append(Piece(name, box, name, (0,) * len(shape)))
    rows, cols = Box((0, 0), (I, H)), Box((0, 0), (H, I))
    for prefix in expert_prefixes:
        local_experts = local_of(prefix)
        gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        buffers[gate_up] = (len(local_experts), 2 * I, H)  # [gate; up] per local expert
        buffers[down] = (len(local_experts), H, I)
        for j, e in enumerate(local_experts):
            pieces += [Piece(f"{prefix}.{e}.gate_proj.weight", rows, gate_up, (j, 0, 0)),
                       Piece(f"{prefix}.{e}.up_proj.weight", rows, gate_up, (j, I, 0)),
                       Piece(f"{prefix}.{e}.down_proj.weight", cols, down, (j, 0, 0))]
    return buffers, tuple(pieces)


def zero3_axis(name: str) -> str | None:
    """The group a parameter's rows are split over under zero_stage=3: its gradient group, except for
    the stage-reduced parameters (router, q/k norms) and the router's correction bias (updated whole by
    `trainer.router_bias_update_rate`), which stay whole."""
    if split_of(name) is Split.experts:
        return "expert_replica"
    return None if grad_reduced_over_stage(name) or name.endswith(".e_score_correction_bias") else "dp"


def shard_rows(d0: int, n: int, i: int) -> tuple[int, int]:
    """Rows [lo, hi) of a dim of length d0 that member i of n holds (the last ones may hold fewer, or none)."""
    c = -(-d0 // n)
    lo = min(i * c, d0)
    return lo, min(lo + c, d0)


def axis_position(layout: Layout, rank: int, axis: str) -> tuple[int, int]:
    """(group size, this rank's position) along `axis`, positions in ascending rank order as
    torch.distributed numbers the members of a group."""
    group = sorted(layout.axis_group(rank, axis))
    return len(group), group.index(rank)


def row_sharded(layout: Layout, rank: int, names) -> dict[str, tuple[str, int, int]]:
    """zero_stage=3: name -> (axis, group size, this rank's position) for the names of `names` whose rows
    are split (group size > 1); the others stay whole."""
    positions = {axis: axis_position(layout, rank, axis) for axis in ("dp", "expert_replica")}
    out = {}
    for name in names:
        axis = zero3_axis(name)
        if axis and positions[axis][0] > 1:
            out[name] = (axis, *positions[axis])
    return out


def _narrow_rows(buffers: dict[str, Shape], pieces, layout: Layout, rank: int):
    """zero_stage=3: keep rows [lo, hi) of each row-sharded buffer and the parts of pieces inside them."""
    ranges: dict[str, tuple[int, int]] = {}
    out_buffers: dict[str, Shape] = {}
    split = row_sharded(layout, rank, buffers)
    for name, shape in buffers.items():
        if name not in split:
            out_buffers[name] = shape
            continue
        _, n, i = split[name]
        ranges[name] = lo, hi = shard_rows(shape[0], n, i)
        out_buffers[name] = (hi - lo,) + tuple(shape[1:])
    out_pieces = []
    for p in pieces:
        if p.buffer not in ranges:
            out_pieces.append(p)
            continue
        lo, hi = ranges[p.buffer]
        bb = p.buffer_box()
        a, b = max(bb.start[0], lo), min(bb.stop[0], hi)
        if a >= b:
            continue
        offset = (a - lo,) + tuple(p.offset[1:])
        if len(p.offset) > len(p.box.size):  # dim 0 is a stacking dim (one expert): kept whole
            out_pieces.append(Piece(p.param, p.box, p.buffer, offset))
        else:
            box = Box((p.box.start[0] + a - bb.start[0],) + tuple(p.box.start[1:]), (b - a,) + tuple(p.box.size[1:]))
            out_pieces.append(Piece(p.param, box, p.buffer, offset))
    return out_buffers, tuple(out_pieces)


def _expert_map(cfg: ModelConfig, layout: Layout, expert_map: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(expert_map) if expert_map is not None else default_expert_map(cfg.num_experts, layout.expert_shards)


def layer_expert_maps(cfg: ModelConfig, layout: Layout, expert_map: Sequence[int] | None = None,
                      expert_maps: Sequence[Sequence[int]] | None = None) -> dict[str, tuple[int, ...]]:
    """Expert-layer prefix (`model.layers.<i>.mlp.experts`) -> its expert -> EP shard map. `expert_maps`: one
    map per MoE layer of the decoder (index i - first_k_dense_layers, the order of the trainer's expert loads),
    as expert-load balancing migrates them; `expert_map` (default: contiguous) for the layers it omits and for
    the MTP modules, which never run and never move."""
    base = _expert_map(cfg, layout, expert_map)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_layers
    if expert_maps is not None and len(expert_maps) != moe_layers:
        raise ValueError(f"{len(expert_maps)} per-layer expert maps for {moe_layers} MoE layers")
    out = {}
    for name in param_shapes(cfg):
        m = _PER_EXPERT.match(name)
        if m is None or m.group(2) != "0" or m.group(3) != "gate":
            continue
        i = int(_LAYER.match(name).group(1))
        emap = base
        if expert_maps is not None and i < cfg.num_hidden_layers:
            emap = tuple(expert_maps[i - cfg.first_k_dense_layers])
            check_expert_map(emap, cfg.num_experts, layout.expert_shards)
        out[m.group(1)] = emap
    return out


def _local_of(cfg, layout: Layout, rank: int, maps: dict[str, tuple[int, ...]]) -> Callable[[str], tuple[int, ...]]:
    memo: dict[tuple[int, ...], tuple[int, ...]] = {}

    def local_of(prefix: str) -> tuple[int, ...]:
        emap = maps[prefix]
        if emap not in memo:
            memo[emap] = layout.experts(rank, cfg.num_experts, emap)
        return memo[emap]
    return local_of


def rank_sharding(cfg: ModelConfig, layout: Layout, rank: int, expert_map: Sequence[int] | None = None,
                  stage_split: Sequence[int] | None = None, zero_stage: int = 1,
                  expert_maps: Sequence[Sequence[int]] | None = None) -> TrainerSharding:
    c = layout.coords(rank)
    dense, experts = _stage_tables(cfg, layout.stage_layers(cfg.num_hidden_layers, stage_split))
    local = _local_of(cfg, layout, rank, layer_expert_maps(cfg, layout, expert_map, expert_maps))
    buffers, pieces = _rank_buffers_and_pieces(cfg, dense[c.pp], experts[c.pp], c.tp, layout.tp, local)
    if zero_stage == 3:
        buffers, pieces = _narrow_rows(buffers, pieces, layout, rank)
    return TrainerSharding(rank, buffers, pieces)


def trainer_shard_spec(cfg: ModelConfig, layout: Layout, expert_map: Sequence[int] | None = None,
                       stage_split: Sequence[int] | None = None, rank_offset: int = 0,
                       zero_stage: int = 1, expert_maps: Sequence[Sequence[int]] | None = None) -> ShardSpec:
    """The whole trainer's shard spec; ranks numbered from `rank_offset` in the transfer world. Ranks
    with the same stage, TP index and expert shard (DP replicas) share one description; with
    zero_stage=3 the DP and expert-replica positions tell the row shards apart."""
    dense, experts = _stage_tables(cfg, layout.stage_layers(cfg.num_hidden_layers, stage_split))
    maps = layer_expert_maps(cfg, layout, expert_map, expert_maps)
    memo: dict[tuple[int, int, int], tuple] = {}
    ranks = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        key = (c.pp, c.tp, layout.ep_index(r))
        if zero_stage == 3:
            key += (axis_position(layout, r, "dp")[1], axis_position(layout, r, "expert_replica")[1])
        if key not in memo:
            buffers, pieces = _rank_buffers_and_pieces(cfg, dense[c.pp], experts[c.pp], c.tp, layout.tp,
                                                       _local_of(cfg, layout, r, maps))
            if zero_stage == 3:
                buffers, pieces = _narrow_rows(buffers, pieces, layout, r)
            memo[key] = (tuple(buffers.items()), pieces)
        ranks.append(RankShards(rank_offset + r, *memo[key]))
    return ShardSpec(f"trainer {layout}", tuple(param_shapes(cfg).items()), tuple(ranks), cfg.dtype.value)
