"""Canonical parameter table of a model shape: HF checkpoint name -> global shape.

Pure (no torch): computed from `ModelConfig` alone, for every architecture the schema describes,
including those the torch model does not build (MLA, shared experts, MTP: DeepSeek-V3 naming, which
Pangu Ultra MoE follows). Sharding specs, resharding plans, memory estimates and the simulator all
start from this table; for Qwen3-MoE it equals what `rlhf.model.hf_io` writes.
"""

from __future__ import annotations

from rlhf.schema import Attention, ModelConfig, RouterScoring

Shape = tuple[int, ...]


def _attention(cfg: ModelConfig, p: str) -> dict[str, Shape]:
    H, N, K, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if cfg.attention is Attention.gqa:
        return {
            f"{p}.q_proj.weight": (N * D, H), f"{p}.k_proj.weight": (K * D, H),
            f"{p}.v_proj.weight": (K * D, H), f"{p}.o_proj.weight": (H, N * D),
            f"{p}.q_norm.weight": (D,), f"{p}.k_norm.weight": (D,),
        }
    m = cfg.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    out = {}
    if m.q_lora_rank > 0:
        out |= {f"{p}.q_a_proj.weight": (m.q_lora_rank, H), f"{p}.q_a_layernorm.weight": (m.q_lora_rank,),
                f"{p}.q_b_proj.weight": (N * qk, m.q_lora_rank)}
    else:
        out[f"{p}.q_proj.weight"] = (N * qk, H)
    return out | {
        f"{p}.kv_a_proj_with_mqa.weight": (m.kv_lora_rank + m.qk_rope_head_dim, H),
        f"{p}.kv_a_layernorm.weight": (m.kv_lora_rank,),
        f"{p}.kv_b_proj.weight": (N * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        f"{p}.o_proj.weight": (H, N * m.v_head_dim),
    }


def _mlp(p: str, H: int, I: int) -> dict[str, Shape]:
    return {f"{p}.gate_proj.weight": (I, H), f"{p}.up_proj.weight": (I, H), f"{p}.down_proj.weight": (H, I)}


def _layer(cfg: ModelConfig, i: int) -> dict[str, Shape]:
    H, p = cfg.hidden_size, f"model.layers.{i}"
    out = _attention(cfg, f"{p}.self_attn")
    out |= {f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,)}
    if i < cfg.first_k_dense_layers:
        return out | _mlp(f"{p}.mlp", H, cfg.intermediate_size)
    out[f"{p}.mlp.gate.weight"] = (cfg.num_experts, H)
    if cfg.router_scoring is RouterScoring.sigmoid:
        out[f"{p}.mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
    for e in range(cfg.num_experts):
        out |= _mlp(f"{p}.mlp.experts.{e}", H, cfg.moe_intermediate_size)
    if cfg.num_shared_experts:
        out |= _mlp(f"{p}.mlp.shared_experts", H, cfg.num_shared_experts * cfg.shared_expert_intermediate_size)
    return out


def param_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Every checkpoint tensor with its global shape, in checkpoint order."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Shape] = {"model.embed_tokens.weight": (V, H)}
    for i in range(cfg.num_hidden_layers):
        out |= _layer(cfg, i)
    for k in range(cfg.num_mtp_layers):  # DeepSeek-V3 layout: MTP modules follow the last layer
        i = cfg.num_hidden_layers + k
        out |= {f"model.layers.{i}.enorm.weight": (H,), f"model.layers.{i}.hnorm.weight": (H,),
                f"model.layers.{i}.eh_proj.weight": (H, 2 * H), f"model.layers.{i}.shared_head.norm.weight": (H,)}
        out |= _layer(cfg, i)
    out["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out


def _numel(shape: Shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def count_params(cfg: ModelConfig, include_mtp: bool = True) -> int:
    shapes = param_shapes(cfg)
    if not include_mtp:
        first_mtp = cfg.num_hidden_layers
        shapes = {k: v for k, v in shapes.items()
                  if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= first_mtp)}
    return sum(_numel(s) for s in shapes.values())


def count_active_params(cfg: ModelConfig) -> int:
    """Parameters one token touches (top-k routed experts of each MoE layer, MTP excluded)."""
    total = count_params(cfg, include_mtp=False)
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_layers
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    return total - moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert


def route_bytes_per_step(moe_layers: int, top_k: int, samples: int, tokens_per_sample: int) -> int:
    """Routing replay: the routes of one step at most, as the trainer receives them (int16 ids,
    `rlhf.moe.routing.ROUTE_DTYPE`): every sample at its longest, one id per MoE layer and top-k slot.
    The engines return them at one byte per id up to 256 experts, half of this."""
    return samples * tokens_per_sample * moe_layers * top_k * 2


def kv_per_token_layer(m: ModelConfig, tp: int = 1) -> int:
    """KV-cache elements a token takes in one layer on one engine rank of `tp`: GQA's keys and values of the
    rank's KV heads (a head replicated where tp exceeds them), MLA's compressed latent and rope key (whole)."""
    if m.attention is Attention.mla:
        return m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    return 2 * max(1, m.num_key_value_heads // tp) * m.head_dim
