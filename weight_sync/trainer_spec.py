"""The trainer's shard spec as the planner needs it, for every model shape the schema describes. Pure.

`rlhf.model.sharding.trainer_shard_spec` is the contract for what the trainer holds, but it derives
the tensor list from the Qwen3-MoE modules (GQA attention, no shared experts, no router bias, no MTP).
For MLA shapes such as Pangu Ultra MoE 718B its pieces name tensors the checkpoint does not have
(`q_proj` of N * head_dim rows, `q_norm`, ...) and leave the MLA, shared-expert, router-bias and MTP
tensors uncovered, so no plan can be built from it.

`trainer_spec` returns `trainer_shard_spec` for the shapes it describes, and otherwise a stand-in that
applies the same rules to the checkpoint's own names (`param_shapes`):

- column parallel (rows over tp): q_proj, q_b_proj, kv_b_proj, dense and shared-expert gate/up;
- row parallel (columns over tp): o_proj, dense and shared-expert down_proj;
- k_proj / v_proj by KV head, replicated by head group when tp exceeds the KV heads;
- routed experts stacked per layer in `mlp.experts.gate_up_proj` [E_local, 2I, H] ([gate; up] per
  local expert) and `mlp.experts.down_proj` [E_local, H, I], whole experts split by the expert map
  over the EP group;
- everything else replicated (norms, router, q_a / kv_a projections, MTP's eh_proj);
- pipeline stages own contiguous layer ranges; embedding on the first, MTP modules, final norm and
  lm_head on the last.

For Qwen3-MoE shapes the stand-in equals `trainer_shard_spec` (a test holds them together). It should
move into `rlhf.model.sharding` once the trainer builds MLA models.
"""

from __future__ import annotations

import re
from typing import Sequence

from rlhf.config.schema import Attention, ModelConfig, RouterScoring
from rlhf.model.shapes import param_shapes
from rlhf.model.sharding import trainer_shard_spec
from weight_sync.layout import Layout, default_expert_map
from weight_sync.spec import Box, Piece, RankShards, ShardSpec

Shape = tuple[int, ...]

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_RULES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), s) for p, s in (
    (r"\.self_attn\.(q|q_b|kv_b)_proj\.weight$", "rows"),
    (r"\.self_attn\.[kv]_proj\.weight$", "kv_rows"),
    (r"\.self_attn\.o_proj\.weight$", "cols"),
    (r"\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$", "rows"),
    (r"\.mlp\.(shared_experts\.)?down_proj\.weight$", "cols"),
))


def trainer_describes(cfg: ModelConfig) -> bool:
    """Whether `rlhf.model.sharding` covers this shape (its module list is Qwen3-MoE's)."""
    return (cfg.attention is Attention.gqa and not cfg.num_shared_experts and not cfg.num_mtp_layers
            and cfg.router_scoring is not RouterScoring.sigmoid)


def trainer_spec(cfg: ModelConfig, layout: Layout, expert_map: Sequence[int] | None = None,
                 stage_split: Sequence[int] | None = None, rank_offset: int = 0) -> ShardSpec:
    """The trainer's spec: `trainer_shard_spec` where it describes the model, else the stand-in."""
    if trainer_describes(cfg):
        return trainer_shard_spec(cfg, layout, expert_map, stage_split, rank_offset)
    return stand_in_trainer_spec(cfg, layout, expert_map, stage_split, rank_offset)


def _split_of(name: str) -> str:
    for pattern, split in _RULES:
        if pattern.search(name):
            return split
    return "replicate"


def _stage_of(name: str, cfg: ModelConfig, stages: Sequence[range]) -> int:
    if name.startswith("model.embed_tokens."):
        return 0
    m = _LAYER.match(name)
    if m and int(m.group(1)) < cfg.num_hidden_layers:
        return next(s for s, r in enumerate(stages) if int(m.group(1)) in r)
    return len(stages) - 1  # MTP modules, final norm, lm_head


def _dense_piece(name: str, shape: Shape, split: str, cfg: ModelConfig, t: int, tp: int) -> Piece:
    K, D = cfg.num_key_value_heads, cfg.head_dim
    if split == "rows" or (split == "kv_rows" and K % tp == 0):
        rows = shape[0] // tp
        box = Box((t * rows, 0), (rows, shape[1]))
    elif split == "kv_rows":  # tp > K: the one KV head this rank's query heads use
        box = Box((t * K // tp * D, 0), (D, shape[1]))
    elif split == "cols":
        cols = shape[1] // tp
        box = Box((0, t * cols), (shape[0], cols))
    else:
        box = Box.full(shape)
    return Piece(name, box, name, (0,) * len(shape))


def _expert_pieces(prefix: str, experts: Sequence[int], H: int, I: int) -> list[Piece]:
    gate_up, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    rows, cols = Box((0, 0), (I, H)), Box((0, 0), (H, I))
    out = []
    for j, e in enumerate(experts):
        out.append(Piece(f"{prefix}.{e}.gate_proj.weight", rows, gate_up, (j, 0, 0)))
        out.append(Piece(f"{prefix}.{e}.up_proj.weight", rows, gate_up, (j, I, 0)))
    return out + [Piece(f"{prefix}.{e}.down_proj.weight", cols, down, (j, 0, 0)) for j, e in enumerate(experts)]


def stand_in_trainer_spec(cfg: ModelConfig, layout: Layout, expert_map: Sequence[int] | None = None,
                          stage_split: Sequence[int] | None = None, rank_offset: int = 0) -> ShardSpec:
    """The trainer's rules applied to the checkpoint's names (see the module docstring)."""
    shapes = param_shapes(cfg)
    stages = layout.stage_layers(cfg.num_hidden_layers, stage_split)
    emap = tuple(expert_map) if expert_map is not None else default_expert_map(cfg.num_experts, layout.expert_shards)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    dense: list[list[tuple[str, Shape, str]]] = [[] for _ in stages]  # per stage: (name, shape, split)
    expert_layers: list[list[str]] = [[] for _ in stages]  # per stage: "model.layers.{l}.mlp.experts"
    for name, shape in shapes.items():
        m = _EXPERT.match(name)
        stage = _stage_of(name, cfg, stages)
        if m is None:
            dense[stage].append((name, shape, _split_of(name)))
        elif m.group(2) == "0" and m.group(3) == "gate":
            expert_layers[stage].append(m.group(1))
    # Pieces do not name their rank: DP replicas (same stage and tp index) share them.
    memo: dict[tuple[int, int, int], tuple[tuple, tuple]] = {}
    ranks = []
    for r in range(layout.world_size):
        c = layout.coords(r)
        key = (c.pp, c.tp, layout.ep_index(r))
        if key not in memo:
            pieces = [_dense_piece(n, s, split, cfg, c.tp, layout.tp) for n, s, split in dense[c.pp]]
            local = layout.experts(r, E, emap)
            for prefix in expert_layers[c.pp]:
                pieces += _expert_pieces(prefix, local, H, I)
            buffers = {p.buffer: p.box.size for p in pieces if len(p.offset) == len(p.box.size)}
            for prefix in expert_layers[c.pp]:
                buffers[f"{prefix}.gate_up_proj"] = (len(local), 2 * I, H)
                buffers[f"{prefix}.down_proj"] = (len(local), H, I)
            memo[key] = (tuple(buffers.items()), tuple(pieces))
        ranks.append(RankShards(rank_offset + r, *memo[key]))
    return ShardSpec(f"trainer {layout} (stand-in)", tuple(shapes.items()), tuple(ranks), cfg.dtype.value)
