from pathlib import Path

from rlhf.config import load_model_config
from rlhf.model.shapes import count_active_params, count_params, param_shapes
import pytest
import torch

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


@pytest.mark.parametrize("name", ["pangu_ultra_moe_718b", "pangu_moe_tiny", "qwen3_moe_small", "qwen3_30b_a3b"])
def test_the_table_is_what_the_model_builds(name):
    """Built on the meta device (no memory), the torch model writes exactly the tensors of the shape table that
    planning, memory estimates and the simulator count."""
    from rlhf.model.hf_io import to_hf_tensors
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    cfg = load_model_config(MODELS / f"{name}.yaml")
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    built = {n: tuple(t.shape) for n, t in to_hf_tensors(model.state_dict(), cfg)}
    assert built == param_shapes(cfg)
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)
