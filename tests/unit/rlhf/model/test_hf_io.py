import json

import pytest
import torch

from rlhf.schema import DType, ModelConfig
from rlhf.model.hf_io import (
    INDEX_FILE, from_hf_tensors, iter_safetensors, load_config, load_pretrained, save_pretrained, to_hf_tensors,
)
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.model.shapes import param_shapes


def _cfg(**kw):
    return ModelConfig(**(dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=24, intermediate_size=40) | kw))


def _model(cfg, seed=3):
    m = Qwen3MoeForCausalLM(cfg)
    m.init_weights(seed, std=0.5)
    return m.to(torch.bfloat16) if cfg.dtype is DType.bfloat16 else m


@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": True, "first_k_dense_layers": 1},
                                {"dtype": DType.bfloat16}])
@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 20_000])
def test_save_load_round_trip_is_bit_exact(tmp_path, kw, max_shard_bytes):
    cfg = _cfg(**kw)
    model = _model(cfg)
    save_pretrained(model, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / INDEX_FILE).is_file() == (max_shard_bytes < 2 << 30)
    back = load_pretrained(tmp_path)
    assert back.config == load_config(tmp_path)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    if cfg.tie_word_embeddings:
        assert back.lm_head.weight is back.model.embed_tokens.weight


def test_checkpoint_uses_per_expert_names_with_canonical_shapes(tmp_path):
    cfg = _cfg(first_k_dense_layers=1)
    save_pretrained(_model(cfg), tmp_path)
    on_disk = {name: tuple(t.shape) for name, t in iter_safetensors(tmp_path)}
    assert on_disk == param_shapes(cfg)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in on_disk


def test_config_json_is_read_by_transformers(tmp_path):
    import transformers
    cfg = _cfg(first_k_dense_layers=1)
    save_pretrained(_model(cfg), tmp_path)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "qwen3_moe"
    assert (hf.num_experts, hf.num_experts_per_tok, hf.head_dim, hf.mlp_only_layers) == (4, 2, 16, [0])
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]


def test_missing_expert_tensor_is_named():
    cfg = _cfg()
    pairs = [(n, t) for n, t in to_hf_tensors(_model(cfg).state_dict(), cfg)
             if n != "model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj"):
        from_hf_tensors(pairs, cfg)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="HF model directory"):
        load_pretrained(tmp_path)
