"""How the trainer shards the Qwen3-MoE model, declared as data; and the shard spec it implies. Pure.

One rule per parameter kind (matched on our in-memory names): which mesh axis splits which tensor
dim. Column-parallel projections split dim 0 over `tp`, row-parallel ones dim 1; KV projections are
split by head, or replicated by head group when tp exceeds the KV heads; stacked routed experts are
split along dim 0 by an expert -> shard map (EP); everything else is replicated. Pipeline stages
own contiguous layer ranges; the embedding sits on the first stage, the final norm and lm_head on the
last. Data-parallel ranks hold full replicas of their stage's shards (optimizer state is what DP
shards).

`trainer_shard_spec` turns these rules into a `ShardSpec` in canonical HF names: the contract between
the parallel trainer (which slices its parameters with `local_tensors`) and the resharding planner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Sequence

from rlhf.config.schema import ModelConfig
from weight_sync.layout import Layout, default_expert_map
from weight_sync.spec import Box, Piece, ShardSpec, spec_from_mapping

Shape = tuple[int, ...]


class Split(Enum):
    replicate = "replicate"
    tp_rows = "tp_rows"  # column parallel: dim 0 over tp
    tp_cols = "tp_cols"  # row parallel: dim 1 over tp
    tp_kv_rows = "tp_kv_rows"  # dim 0 by KV head over tp; replicated by head group when tp > KV heads
    experts = "experts"  # stacked experts: dim 0 by the expert map over the EP group


SHARDING_RULES: tuple[tuple[str, Split], ...] = (
    (r"\.self_attn\.q_proj\.weight$", Split.tp_rows),
    (r"\.self_attn\.[kv]_proj\.weight$", Split.tp_kv_rows),
    (r"\.self_attn\.o_proj\.weight$", Split.tp_cols),
    (r"\.mlp\.(gate|up)_proj\.weight$", Split.tp_rows),
    (r"\.mlp\.down_proj\.weight$", Split.tp_cols),
    (r"\.mlp\.experts\.(gate_up_proj|down_proj)$", Split.experts),
)


# Replicated parameters whose gradient each rank only sees part of, so it is summed over the whole
# stage (dp x tp) rather than over dp alone: q/k norms act on this TP rank's heads only; the router
# sees this rank's slice of the tokens (MoE blocks split the TP group's tokens).
STAGE_REDUCED_GRADS: tuple[str, ...] = (r"\.self_attn\.[qk]_norm\.weight$", r"\.mlp\.gate\.weight$")


def grad_reduced_over_stage(name: str) -> bool:
    return any(re.search(p, name) for p in STAGE_REDUCED_GRADS)


def split_of(name: str) -> Split:
    for pattern, split in SHARDING_RULES:
        if re.search(pattern, name):
            return split
    return Split.replicate


def native_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Global shapes of our in-memory parameters (stacked experts), in module order."""
    H, N, K, D, E, I = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                        cfg.num_experts, cfg.moe_intermediate_size)
    out: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}"
        out |= {f"{p}.self_attn.q_proj.weight": (N * D, H), f"{p}.self_attn.k_proj.weight": (K * D, H),
                f"{p}.self_attn.v_proj.weight": (K * D, H), f"{p}.self_attn.o_proj.weight": (H, N * D),
                f"{p}.self_attn.q_norm.weight": (D,), f"{p}.self_attn.k_norm.weight": (D,)}
        if l < cfg.first_k_dense_layers:
            Id = cfg.intermediate_size
            out |= {f"{p}.mlp.gate_proj.weight": (Id, H), f"{p}.mlp.up_proj.weight": (Id, H),
                    f"{p}.mlp.down_proj.weight": (H, Id)}
        else:
            out |= {f"{p}.mlp.gate.weight": (E, H), f"{p}.mlp.experts.gate_up_proj": (E, 2 * I, H),
                    f"{p}.mlp.experts.down_proj": (E, H, I)}
        out |= {f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,)}
    out["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, H)
    return out


def stage_of(name: str, cfg: ModelConfig, stages: Sequence[range]) -> int:
    if name.startswith("model.embed_tokens."):
        return 0
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        layer = int(m.group(1))
        return next(s for s, r in enumerate(stages) if layer in r)
    return len(stages) - 1  # final norm, lm_head


@dataclass(frozen=True)
class TrainerSharding:
    """The shards of one trainer rank: local shape of each owned parameter and its HF pieces."""

    rank: int
    local_shapes: dict[str, Shape]
    pieces: tuple[Piece, ...]


def _hf_pieces(name: str, split: Split, cfg: ModelConfig, box: Box, local_experts: Sequence[int]) -> list[Piece]:
    """Pieces (HF names) of our parameter `name` whose local tensor holds `box` of our global tensor."""
    if split is not Split.experts:
        return [Piece(name, box, name, (0,) * len(box.size))]
    I = cfg.moe_intermediate_size
    prefix = name.rsplit(".", 1)[0]
    out = []
    for j, e in enumerate(local_experts):
        if name.endswith("gate_up_proj"):
            out.append(Piece(f"{prefix}.{e}.gate_proj.weight", Box((0, 0), (I, cfg.hidden_size)), name, (j, 0, 0)))
            out.append(Piece(f"{prefix}.{e}.up_proj.weight", Box((0, 0), (I, cfg.hidden_size)), name, (j, I, 0)))
        else:
            out.append(Piece(f"{prefix}.{e}.down_proj.weight", Box((0, 0), (cfg.hidden_size, I)), name, (j, 0, 0)))
    return out


def rank_sharding(cfg: ModelConfig, layout: Layout, rank: int, expert_map: Sequence[int] | None = None,
                  stage_split: Sequence[int] | None = None) -> TrainerSharding:
    c = layout.coords(rank)
    stages = layout.stage_layers(cfg.num_hidden_layers, stage_split)
    emap = tuple(expert_map) if expert_map is not None else default_expert_map(cfg.num_experts, layout.expert_shards)
    local_experts = layout.experts(rank, cfg.num_experts, emap)
    K, D, tp = cfg.num_key_value_heads, cfg.head_dim, layout.tp
    shapes: dict[str, Shape] = {}
    pieces: list[Piece] = []
    for name, shape in native_shapes(cfg).items():
        if stage_of(name, cfg, stages) != c.pp:
            continue
        split = split_of(name)
        if split is Split.tp_rows or (split is Split.tp_kv_rows and K % tp == 0):
            rows = shape[0] // tp
            box = Box((c.tp * rows, 0), (rows, shape[1]))
        elif split is Split.tp_kv_rows:  # tp > K: each rank needs the one KV head its query heads use
            head = c.tp * K // tp
            box = Box((head * D, 0), (D, shape[1]))
        elif split is Split.tp_cols:
            cols = shape[1] // tp
            box = Box((0, c.tp * cols), (shape[0], cols))
        elif split is Split.experts:
            box = Box((0,) * len(shape), (len(local_experts),) + shape[1:])  # local stacking; pieces map experts
        else:
            box = Box.full(shape)
        shapes[name] = box.size
        pieces += _hf_pieces(name, split, cfg, box, local_experts)
    return TrainerSharding(rank, shapes, tuple(_to_hf_names(pieces, cfg)))


def _to_hf_names(pieces: list[Piece], cfg: ModelConfig) -> list[Piece]:
    """Non-expert pieces already use HF names (ours equal them); tied lm_head is not a separate tensor."""
    return [p for p in pieces if not (cfg.tie_word_embeddings and p.param == "lm_head.weight")]


def trainer_shard_spec(cfg: ModelConfig, layout: Layout, expert_map: Sequence[int] | None = None,
                       stage_split: Sequence[int] | None = None, rank_offset: int = 0) -> ShardSpec:
    """The whole trainer's shard spec; ranks numbered from `rank_offset` in the transfer world."""
    from rlhf.model.shapes import param_shapes

    per_rank = {}
    for r in range(layout.world_size):
        s = rank_sharding(cfg, layout, r, expert_map, stage_split)
        pieces = [Piece(p.param, p.box, p.buffer, p.offset) for p in s.pieces]
        per_rank[rank_offset + r] = (s.local_shapes, pieces)
    spec = spec_from_mapping(f"trainer {layout}", param_shapes(cfg), per_rank, cfg.dtype.value)
    return spec


def local_tensors(full_hf: Mapping[str, "object"], sharding: TrainerSharding):
    """Build a rank's local parameters from full HF-named tensors, following its pieces exactly."""
    import torch

    local = {}
    for name, shape in sharding.local_shapes.items():
        local[name] = torch.empty(shape, dtype=next(iter(full_hf.values())).dtype)
    for p in sharding.pieces:
        local[p.buffer][p.buffer_slices()] = full_hf[p.param][p.box.slices()]
    return local
