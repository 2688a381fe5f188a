"""config.json of the DeepSeek-V3 family (Pangu Ultra MoE follows it), both ways, in the keys the released
DeepSeek-V3 checkpoints use: transformers' DeepseekV3Config and vLLM's DeepseekV2/V3 model read them.
Pure: no torch."""

from __future__ import annotations

from rlhf.schema import Architecture, Attention, DType, MLAConfig, ModelConfig, RopeScaling, RouterScoring


def deepseek_v3_config(cfg: ModelConfig) -> dict:
    m, s = cfg.mla, cfg.rope_scaling
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if s is not None and s.factor > 1:
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": s.factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings,
                   "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                   "mscale_all_dim": s.mscale_all_dim}
        rope = {**scaling, "rope_theta": cfg.rope_theta}
        del rope["type"]
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "n_shared_experts": cfg.num_shared_experts,
        "n_routed_experts": cfg.num_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "kv_lora_rank": m.kv_lora_rank,
        "q_lora_rank": m.q_lora_rank or None,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_layer_freq": 1,
        "first_k_dense_replace": cfg.first_k_dense_layers,
        "norm_topk_prob": cfg.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope,
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": cfg.dtype.value,
        "use_cache": True,
    }


def common_fields(d: dict) -> dict:
    """What Qwen3-MoE and DeepSeek-V3 config.json files say alike: embeddings tie, dtype, special tokens."""
    return dict(
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        dtype=DType(d.get("torch_dtype") or d.get("dtype") or "float32"),
        bos_token_id=d.get("bos_token_id") or 0,
        eos_token_id=d.get("eos_token_id") or 0,
        pad_token_id=d.get("pad_token_id") or 0,
    )


def model_config_from_deepseek_v3(d: dict, name: str) -> ModelConfig:
    """Our schema from a DeepSeek-V3 config.json; refuses what the torch model does not build."""
    problems = []
    if d.get("scoring_func", "sigmoid") != "sigmoid" or d.get("topk_method", "noaux_tc") != "noaux_tc":
        problems.append(f"scoring_func={d.get('scoring_func')!r}, topk_method={d.get('topk_method')!r} "
                        "(only sigmoid with noaux_tc, as DeepSeek-V3)")
    if d.get("moe_layer_freq", 1) != 1:
        problems.append(f"moe_layer_freq={d['moe_layer_freq']} (only 1: every layer after the dense ones is MoE)")
    if d.get("num_key_value_heads", d["num_attention_heads"]) != d["num_attention_heads"]:
        problems.append("num_key_value_heads differs from num_attention_heads (MLA has one latent for all heads)")
    if not d.get("rope_interleave", True):
        problems.append("rope_interleave=false (DeepSeek checkpoints interleave the rotary dimensions)")
    scaling = d.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "yarn"):
        problems.append(f"rope_scaling type {kind!r} (default or yarn)")
    if problems:
        raise ValueError(f"config.json ({name}): cannot build " + "; ".join(problems))
    rope = d.get("rope_parameters") or {}
    return ModelConfig(
        name=name,
        architecture=Architecture.pangu_moe,
        attention=Attention.mla,
        router_scoring=RouterScoring.sigmoid,
        mla=MLAConfig(q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
                      qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                      v_head_dim=d["v_head_dim"]),
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d["num_attention_heads"],
        head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"],
        num_experts=d["n_routed_experts"],
        num_experts_per_tok=d["num_experts_per_tok"],
        moe_intermediate_size=d["moe_intermediate_size"],
        norm_topk_prob=d.get("norm_topk_prob", True),
        n_group=d.get("n_group") or 1,
        topk_group=d.get("topk_group") or 1,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        num_shared_experts=d.get("n_shared_experts") or 0,
        shared_expert_intermediate_size=d["moe_intermediate_size"] if d.get("n_shared_experts") else 0,
        first_k_dense_layers=d.get("first_k_dense_replace", 0),
        intermediate_size=d["intermediate_size"],
        num_mtp_layers=d.get("num_nextn_predict_layers", 0),
        rms_norm_eps=d["rms_norm_eps"],
        rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
        rope_scaling=None if kind == "default" else RopeScaling(
            factor=float(scaling["factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
            mscale=float(scaling.get("mscale") or 0), mscale_all_dim=float(scaling.get("mscale_all_dim") or 0)),
        max_position_embeddings=d["max_position_embeddings"],
        **common_fields(d),
    )
