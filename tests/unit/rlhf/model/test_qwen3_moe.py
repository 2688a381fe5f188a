"""Our Qwen3-MoE equals transformers' implementation on the same weights (fp32, <= 1e-5)."""

import pytest
import torch

from rlhf.schema import Architecture, Attention, MLAConfig, ModelConfig
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

import transformers

CASES = {
    "base": dict(),
    "tied_dense_first": dict(tie_word_embeddings=True, first_k_dense_layers=1),
    "mha_no_topk_norm": dict(num_key_value_heads=4, norm_topk_prob=False, num_experts_per_tok=3),
    "mqa_top1": dict(num_key_value_heads=1, num_experts_per_tok=1, num_experts=5),
}


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
                rope_theta=10000.0)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(tmp_path, case):
    cfg = tiny_cfg(**CASES[case])
    ours = Qwen3MoeForCausalLM(cfg).eval()
    ours.init_weights(seed=7, std=0.2)  # large weights: routing and attention far from uniform
    save_pretrained(ours, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert_logits_equal(ours, theirs, cfg.vocab_size)


def assert_logits_equal(ours, theirs, vocab_size: int) -> None:
    """Same parameter names; logits within 1e-5 on random ids, without and with left padding."""
    assert set(theirs.state_dict()) == set(ours.state_dict()), "parameter names differ from transformers'"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[2, :2] = 0
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5
        diff = (ours(ids, mask) - theirs(ids, attention_mask=mask).logits)[mask.bool()]
        assert diff.abs().max().item() <= 1e-5


def test_router_stats_count_valid_tokens_per_expert():
    cfg = tiny_cfg(first_k_dense_layers=1)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=1, std=0.2)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        model(ids, mask)
    stats = model.router_stats()
    assert stats.shape == (cfg.num_hidden_layers - 1, cfg.num_experts)
    assert (stats.sum(1) == int(mask.sum()) * cfg.num_experts_per_tok).all()
    with torch.no_grad():
        model(ids)
    assert (model.router_stats().sum(1) == ids.numel() * cfg.num_experts_per_tok).all()


def test_gradients_flow_to_every_parameter():
    cfg = tiny_cfg()
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=2, std=0.2)
    model(torch.randint(0, cfg.vocab_size, (4, 16))).logsumexp(-1).mean().backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert dead == []


@pytest.mark.parametrize("kw", [dict(attention=Attention.mla, mla=MLAConfig()), dict(num_shared_experts=1,
                                shared_expert_intermediate_size=8), dict(architecture=Architecture.pangu_moe)])
def test_unbuilt_shapes_are_refused_clearly(kw):
    with pytest.raises(NotImplementedError, match="planned and simulated"):
        Qwen3MoeForCausalLM(tiny_cfg(**kw))
