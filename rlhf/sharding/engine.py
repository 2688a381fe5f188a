"""How a vLLM engine shards the model, declared as data: the shard spec of each engine rank's buffers, in
HF names. Pure. The other side of a weight sync from `rlhf.sharding.trainer` (the trainer's).

One engine (`rlhf.sharding.layout.InferenceLayout`) has W ranks: W = tp when ep == 1, else W = ep (ep a
multiple of tp). With ep > tp the engine runs vLLM's data-parallel attention: ep / tp groups of tp consecutive
ranks, each group holding the attention, dense MLPs, shared experts, norms and vocabulary split over its tp
ranks; the routed
experts are split over all W ranks by an expert map (whole experts, as vLLM's expert parallelism
does). With ep == 1 every rank holds all experts with the intermediate dim split over tp.

Redundant experts (vLLM's EPLB, `num_redundant_experts`): with R of them an engine holds E + R physical
experts, (E + R) / ep per rank; physical slot p lives on rank p // ((E + R) / ep) and holds logical
expert `physical_experts[p]` (vLLM's physical-to-logical map; by default the first R experts twice).
A logical expert held in several slots is sent to each of them.

Buffers carry vLLM's names and shapes (Qwen3-MoE, per rank; H hidden, N heads, K KV heads, D head dim,
I expert FFN, Id dense FFN, E experts, V vocabulary):

    model.embed_tokens.weight, lm_head.weight     [Vp / tp, H]   V padded to a multiple of 64
    layers.{l}.self_attn.qkv_proj.weight          [(N / tp + 2 Kloc) D, H]   q rows, then k, then v
    layers.{l}.self_attn.o_proj.weight            [H, N D / tp]
    layers.{l}.mlp.gate_up_proj.weight            [2 Id / tp, H]  gate rows, then up (dense layers)
    layers.{l}.mlp.down_proj.weight               [H, Id / tp]
    layers.{l}.mlp.experts.w13_weight             [E_local, 2 I_local, H]  [gate; up] per local expert
    layers.{l}.mlp.experts.w2_weight              [E_local, H, I_local]
    norms, q_norm / k_norm, mlp.gate.weight       replicated

KV heads are split over tp, or, when tp > K, replicated by head group (rank t holds head t K // tp).
The vocabulary is padded as vLLM's VocabParallelEmbedding does (to a multiple of 64, then split over
tp); pieces leave the padding rows uncovered.

MLA models (DeepSeek-V3 / Pangu Ultra MoE) follow vLLM's DeepSeek-V2 module: `fused_qkv_a_proj`
([q_a; kv_a_with_mqa] rows, replicated), `q_b_proj` and `kv_b_proj` split by rows (heads) over tp,
`o_proj` by columns; shared experts are a dense MLP (`mlp.shared_experts.gate_up_proj`, `down_proj`);
the sigmoid router's `e_score_correction_bias` and the MTP modules' norms and `eh_proj` replicated.

Engines are independent replicas: engine k's ranks follow engine k-1's, from `rank_offset`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from rlhf.schema import Attention, ModelConfig, RouterScoring
from rlhf.model.shapes import param_shapes
from rlhf.sharding.layout import InferenceLayout, check_expert_map, fit_problems, padded_vocab
from weight_sync.spec import Box, Piece, RankShards, ShardSpec

Shape = tuple[int, ...]


class _RankBuilder:
    """Buffers and pieces of one engine rank, appended in storage order."""

    def __init__(self):
        self.buffers: dict[str, Shape] = {}
        self.pieces: list[Piece] = []

    def buffer(self, name: str, shape: Shape) -> None:
        self.buffers[name] = tuple(shape)

    def piece(self, param: str, box: Box, buffer: str, offset: tuple[int, ...]) -> None:
        self.pieces.append(Piece(param, box, buffer, offset))

    def whole(self, param: str, shape: Shape) -> None:
        """A replicated tensor: its own buffer, the whole global tensor."""
        self.buffer(param, shape)
        self.piece(param, Box.full(shape), param, (0,) * len(shape))

    def fused_rows(self, buffer: str, parts: Sequence[tuple[str, int, int, int]]) -> None:
        """A buffer of row blocks [sum rows, cols]: each part (param, first row, rows, cols) in order."""
        cols = parts[0][3]
        at = 0
        for param, first, rows, c in parts:
            self.piece(param, Box((first, 0), (rows, c)), buffer, (at, 0))
            at += rows
        self.buffer(buffer, (at, cols))

    def cols(self, param: str, rows: int, first: int, cols: int) -> None:
        """Row-parallel: columns [first, first + cols) of a [rows, *] tensor, in a buffer of the same name."""
        self.buffer(param, (rows, cols))
        self.piece(param, Box((0, first), (rows, cols)), param, (0, 0))


def _attention(b: _RankBuilder, cfg: ModelConfig, shapes: dict[str, Shape], p: str, t: int, tp: int) -> None:
    H, N, K, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if cfg.attention is Attention.gqa:
        q = N // tp * D
        kv_heads = K // tp if tp <= K else 1
        first_head = t * kv_heads if tp <= K else t * K // tp
        b.fused_rows(f"{p}.qkv_proj.weight", [(f"{p}.q_proj.weight", t * q, q, H),
                                              (f"{p}.k_proj.weight", first_head * D, kv_heads * D, H),
                                              (f"{p}.v_proj.weight", first_head * D, kv_heads * D, H)])
        b.cols(f"{p}.o_proj.weight", H, t * N * D // tp, N * D // tp)
        b.whole(f"{p}.q_norm.weight", shapes[f"{p}.q_norm.weight"])
        b.whole(f"{p}.k_norm.weight", shapes[f"{p}.k_norm.weight"])
        return
    m = cfg.mla
    kv_a = f"{p}.kv_a_proj_with_mqa.weight"
    if m.q_lora_rank > 0:
        b.fused_rows(f"{p}.fused_qkv_a_proj.weight", [(f"{p}.q_a_proj.weight", 0, m.q_lora_rank, H),
                                                      (kv_a, 0, shapes[kv_a][0], H)])
        b.whole(f"{p}.q_a_layernorm.weight", shapes[f"{p}.q_a_layernorm.weight"])
        _rows(b, f"{p}.q_b_proj.weight", shapes, t, tp)
    else:
        _rows(b, f"{p}.q_proj.weight", shapes, t, tp)
        b.whole(kv_a, shapes[kv_a])
    b.whole(f"{p}.kv_a_layernorm.weight", shapes[f"{p}.kv_a_layernorm.weight"])
    _rows(b, f"{p}.kv_b_proj.weight", shapes, t, tp)
    rows, cols = shapes[f"{p}.o_proj.weight"]
    b.cols(f"{p}.o_proj.weight", rows, t * cols // tp, cols // tp)


def _rows(b: _RankBuilder, param: str, shapes: dict[str, Shape], t: int, tp: int) -> None:
    """Column-parallel: rows split over tp, in a buffer of the same name."""
    rows, cols = shapes[param]
    b.fused_rows(param, [(param, t * rows // tp, rows // tp, cols)])


def _dense_mlp(b: _RankBuilder, p: str, H: int, I: int, t: int, tp: int) -> None:
    """vLLM's MergedColumnParallel gate_up_proj (gate rows, then up) and RowParallel down_proj."""
    il = I // tp
    b.fused_rows(f"{p}.gate_up_proj.weight", [(f"{p}.gate_proj.weight", t * il, il, H),
                                              (f"{p}.up_proj.weight", t * il, il, H)])
    b.cols(f"{p}.down_proj.weight", H, t * il, il)


def _experts(b: _RankBuilder, cfg: ModelConfig, p: str, experts: Sequence[int], t: int, split: int) -> None:
    """vLLM's FusedMoE buffers: w13 [E_local, 2 I_local, H] ([gate; up] per expert), w2 [E_local, H, I_local];
    the intermediate dim split over `split` ranks (t is this rank's part)."""
    H, il = cfg.hidden_size, cfg.moe_intermediate_size // split
    w13, w2 = f"{p}.experts.w13_weight", f"{p}.experts.w2_weight"
    b.buffer(w13, (len(experts), 2 * il, H))
    b.buffer(w2, (len(experts), H, il))
    rows, cols = Box((t * il, 0), (il, H)), Box((0, t * il), (H, il))
    for j, e in enumerate(experts):
        b.piece(f"{p}.experts.{e}.gate_proj.weight", rows, w13, (j, 0, 0))
        b.piece(f"{p}.experts.{e}.up_proj.weight", rows, w13, (j, il, 0))
        b.piece(f"{p}.experts.{e}.down_proj.weight", cols, w2, (j, 0, 0))


def _vocab(b: _RankBuilder, param: str, V: int, H: int, t: int, tp: int) -> None:
    per = padded_vocab(V, tp) // tp
    b.buffer(param, (per, H))
    first, last = t * per, min((t + 1) * per, V)
    if last > first:  # a rank may hold only padding rows
        b.piece(param, Box((first, 0), (last - first, H)), param, (0, 0))


def _engine_rank(cfg: ModelConfig, shapes: dict[str, Shape], lay: InferenceLayout, i: int,
                 physical: Mapping[int, tuple[int, ...]], mtp_layers: int
                 ) -> tuple[tuple[tuple[str, Shape], ...], tuple[Piece, ...]]:
    """Buffers and pieces of rank i (0 <= i < W) of one engine; `physical[l]`: layer l's physical experts."""
    tp, t, H = lay.tp, i % lay.tp, cfg.hidden_size
    L = cfg.num_hidden_layers
    b = _RankBuilder()
    _vocab(b, "model.embed_tokens.weight", cfg.vocab_size, H, t, tp)
    for l in range(L + mtp_layers):
        p = f"model.layers.{l}"
        if l >= L:  # MTP module: its own norms and projection, then a decoder layer
            for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm"):
                b.whole(f"{p}.{n}.weight", shapes[f"{p}.{n}.weight"])
        b.whole(f"{p}.input_layernorm.weight", shapes[f"{p}.input_layernorm.weight"])
        _attention(b, cfg, shapes, f"{p}.self_attn", t, tp)
        b.whole(f"{p}.post_attention_layernorm.weight", shapes[f"{p}.post_attention_layernorm.weight"])
        if l < cfg.first_k_dense_layers:
            _dense_mlp(b, f"{p}.mlp", H, cfg.intermediate_size, t, tp)
            continue
        b.whole(f"{p}.mlp.gate.weight", shapes[f"{p}.mlp.gate.weight"])
        if cfg.router_scoring is RouterScoring.sigmoid:
            b.whole(f"{p}.mlp.gate.e_score_correction_bias", shapes[f"{p}.mlp.gate.e_score_correction_bias"])
        if lay.ep == 1:
            _experts(b, cfg, f"{p}.mlp", range(cfg.num_experts), t, tp)
        else:
            per = len(physical[l]) // lay.ep
            _experts(b, cfg, f"{p}.mlp", physical[l][i * per:(i + 1) * per], 0, 1)
        if cfg.num_shared_experts:
            _dense_mlp(b, f"{p}.mlp.shared_experts", H,
                       cfg.num_shared_experts * cfg.shared_expert_intermediate_size, t, tp)
    b.whole("model.norm.weight", shapes["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        _vocab(b, "lm_head.weight", cfg.vocab_size, H, t, tp)
    return tuple(b.buffers.items()), tuple(b.pieces)


def _is_mtp(name: str, num_hidden_layers: int) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= num_hidden_layers


def engine_shard_spec(cfg: ModelConfig, layout: InferenceLayout, rank_offset: int = 0,
                      expert_map: Sequence[int] | None = None, include_mtp: bool = True,
                      physical_experts: Sequence[int] | Mapping[int, Sequence[int]] | None = None,
                      dtype: str | None = None) -> ShardSpec:
    """The shard spec of all `layout.engines` engines, in HF names; engine k's rank i is
    rank_offset + k * W + i. `expert_map[e]` = the engine rank holding expert e when ep > 1 (default
    contiguous; equal counts per rank); the same map for every engine. With redundant experts give
    `physical_experts` instead: the logical expert in each of the E + R physical slots (vLLM EPLB's
    physical-to-logical map), one list for every MoE layer or a dict layer -> list (EPLB balances each
    layer apart); default: experts 0..E-1, then 0..R-1 again. `include_mtp`: the engines hold
    the MTP modules (speculative decoding); without it the spec lists neither their tensors nor pieces.
    `dtype`: the engines' (rollout.dtype; default the model's), what a sync writes into them and sends."""
    problems = fit_problems(cfg, "rollout", layout.tp, layout.ep, engine=True,
                            redundant_experts=layout.redundant_experts)
    if problems:
        raise ValueError(f"inference layout tp={layout.tp} ep={layout.ep} does not fit model {cfg.name}: {problems[0]}")
    mtp = cfg.num_mtp_layers if include_mtp else 0
    physical = _physical_experts(cfg, layout, expert_map, physical_experts, cfg.num_hidden_layers + mtp)
    shapes = param_shapes(cfg)
    if not include_mtp:
        shapes = {n: s for n, s in shapes.items() if not _is_mtp(n, cfg.num_hidden_layers)}
    W = layout.ranks_per_engine
    # Pieces do not name their rank, so every engine shares one engine's (immutable) buffers and pieces.
    per_local = [_engine_rank(cfg, shapes, layout, i, physical, mtp) for i in range(W)]
    ranks = tuple(RankShards(rank_offset + k * W + i, *per_local[i])
                  for k in range(layout.engines) for i in range(W))
    return ShardSpec(f"engines {layout}", tuple(shapes.items()), ranks, dtype or cfg.dtype.value)


def physical_experts(cfg: ModelConfig, lay: InferenceLayout,
                     physical: Sequence[int] | Mapping[int, Sequence[int]] | None = None) -> dict[int, tuple[int, ...]]:
    """Layer -> the logical expert of every physical slot of an engine without MTP modules (rank i holds slots
    i * per .. (i + 1) * per), as `engine_shard_spec` places them; {} for ep = 1."""
    return _physical_experts(cfg, lay, None, physical, cfg.num_hidden_layers)


def _physical_experts(cfg: ModelConfig, lay: InferenceLayout, expert_map: Sequence[int] | None,
                      physical: Sequence[int] | Mapping[int, Sequence[int]] | None,
                      layers: int) -> dict[int, tuple[int, ...]]:
    """Layer -> the logical expert of every physical slot (rank i holds slots i * per .. (i + 1) * per)."""
    E, R = cfg.num_experts, lay.redundant_experts
    if lay.ep == 1:
        if expert_map is not None or physical is not None:
            raise ValueError("expert_map / physical_experts given for an inference layout with ep=1: every rank "
                             "holds every expert")
        return {}
    if expert_map is not None:
        if physical is not None or R:
            raise ValueError("expert_map places each expert on one rank; with redundant experts give "
                             "physical_experts (the logical expert of each physical slot) instead")
        check_expert_map(tuple(expert_map), E, lay.ep)
        slots = tuple(e for i in range(lay.ep) for e in range(E) if expert_map[e] == i)
    elif physical is None:
        slots = tuple(range(E)) + tuple(e % E for e in range(R))
    else:
        slots = None
    moe_layers = [l for l in range(layers) if l >= cfg.first_k_dense_layers]
    if slots is not None:
        return dict.fromkeys(moe_layers, slots)
    per_layer = physical if isinstance(physical, Mapping) else dict.fromkeys(moe_layers, physical)
    if sorted(per_layer) != moe_layers:
        raise ValueError(f"physical_experts names layers {sorted(per_layer)}; the MoE layers are {moe_layers}")
    out = {}
    for l, m in per_layer.items():
        m = tuple(m)
        if len(m) != E + R or any(not 0 <= e < E for e in m) or len(set(m)) != E:
            raise ValueError(f"physical_experts of layer {l}: {len(m)} slots {list(m)[:16]}; expected {E} + {R} "
                             f"redundant = {E + R} slots holding experts 0..{E - 1}, each at least once")
        out[l] = m
    return out
