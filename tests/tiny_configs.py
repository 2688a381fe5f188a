"""Tiny model configs for the resharding tests (importable from every test: tests/ holds conftest.py).
Small enough that a random layout pair plans and runs in milliseconds, shaped like the real ones:
GQA (Qwen3-MoE) or MLA with a shared expert, sigmoid router and an MTP module (DeepSeek-V3 / Pangu)."""

from rlhf.schema import Attention, MLAConfig, ModelConfig, RouterScoring


def gqa(layers: int, kv_heads: int, experts: int, dense: int, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=kv_heads, head_dim=2, num_experts=experts, num_experts_per_tok=2,
                       moe_intermediate_size=4, first_k_dense_layers=dense, intermediate_size=8)


def mla(layers: int, q_lora: int, experts: int, dense: int, vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=8, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=4, head_dim=4, attention=Attention.mla,
                       mla=MLAConfig(q_lora_rank=q_lora, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2,
                                     v_head_dim=2),
                       num_experts=experts, moe_intermediate_size=4, num_shared_experts=1,
                       shared_expert_intermediate_size=4, router_scoring=RouterScoring.sigmoid,
                       first_k_dense_layers=dense, intermediate_size=8, num_mtp_layers=1)
