from pathlib import Path

from rlhf.config import load_model_config
from rlhf.model.shapes import count_active_params, count_params, param_shapes

MODELS = Path(__file__).resolve().parents[4] / "configs" / "model"


def test_published_sizes():
    q30 = load_model_config(MODELS / "qwen3_30b_a3b.yaml")
    assert round(count_params(q30) / 1e9, 1) == 30.5  # Qwen3-30B-A3B: 30.5 B total
    assert 3.2e9 <= count_active_params(q30) <= 3.5e9  # published: 3.3 B activated
    pangu = load_model_config(MODELS / "pangu_ultra_moe_718b.yaml")
    assert 712e9 <= count_params(pangu, include_mtp=False) <= 724e9  # "718B"
    small = load_model_config(MODELS / "qwen3_moe_small.yaml")
    assert 50e6 <= count_params(small) <= 200e6
    tiny = load_model_config(MODELS / "qwen3_moe_tiny.yaml")
    assert 0.2e6 <= count_params(tiny) <= 2e6


def test_pangu_table_has_mla_shared_experts_dense_first_and_mtp():
    pangu = load_model_config(MODELS / "pangu_ultra_moe_718b.yaml")
    shapes = param_shapes(pangu)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (18432, 7680)  # dense-first layer
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in shapes
    assert shapes["model.layers.3.mlp.shared_experts.up_proj.weight"] == (2048, 7680)
    assert shapes["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7680)
    assert shapes["model.layers.61.eh_proj.weight"] == (7680, 2 * 7680)  # the MTP module
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in shapes
