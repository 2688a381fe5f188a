"""The trainer's declared sharding: every layout's spec covers the model, and slicing by it round-trips."""

import pytest
import torch

from rlhf.schema import ModelConfig
from rlhf.model.hf_io import to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.sharding.trainer import Split, rank_sharding, split_of, trainer_shard_spec
from weight_sync.pieces import local_tensors
from rlhf.sharding.layout import Layout

CFG = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                  first_k_dense_layers=1, intermediate_size=40)

LAYOUTS = [Layout(), Layout(tp=2), Layout(dp=2, ep=2), Layout(dp=4, ep=4), Layout(pp=2), Layout(tp=2, ep=2),
           Layout(pp=2, dp=2), Layout(pp=2, tp=2), Layout(dp=2, tp=2, ep=2, experts_over_tp_ep=True),
           Layout(tp=4)]  # tp=4 > 2 KV heads: KV replicated by head group


def test_rules():
    assert split_of("model.layers.0.self_attn.q_proj.weight") is Split.tp_rows
    assert split_of("model.layers.3.mlp.experts.down_proj") is Split.experts
    assert split_of("model.layers.3.mlp.gate.weight") is Split.replicate
    assert split_of("model.layers.0.mlp.down_proj.weight") is Split.tp_cols


@pytest.mark.parametrize("zero_stage", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_spec_covers_and_slicing_reassembles(layout, zero_stage):
    spec = trainer_shard_spec(CFG, layout, zero_stage=zero_stage)
    spec.validate(must_cover=True)
    assert [r.buffers for r in spec.ranks] == [tuple(rank_sharding(CFG, layout, r, zero_stage=zero_stage).local_shapes.items())
                                               for r in range(layout.world_size)]
    model = Qwen3MoeForCausalLM(CFG)
    model.init_weights(0)
    full = {n: t.clone() for n, t in to_hf_tensors(model.state_dict(), CFG)}
    rebuilt = {n: torch.full_like(t, float("nan")) for n, t in full.items()}
    for r in range(layout.world_size):
        s = rank_sharding(CFG, layout, r, zero_stage=zero_stage)
        local = local_tensors(full, s)
        for p in s.pieces:
            rebuilt[p.param][p.box.slices()] = local[p.buffer][p.buffer_slices()]
    for n in full:
        assert torch.equal(rebuilt[n], full[n]), n


def test_zero3_splits_replicated_rows_over_dp_and_experts_over_their_replicas():
    layout = Layout(dp=4, ep=2)  # expert replicas: 2
    one, three = rank_sharding(CFG, layout, 1), rank_sharding(CFG, layout, 1, zero_stage=3)
    assert three.local_shapes["model.embed_tokens.weight"] == (10, 32)  # 40 rows over dp 4: rank 1 rows 10-19
    assert three.local_shapes["model.norm.weight"] == (8,)
    assert three.local_shapes["model.layers.1.mlp.experts.gate_up_proj"] == (2, 48, 32)  # 4 local experts / 2
    assert three.local_shapes["model.layers.1.mlp.gate.weight"] == one.local_shapes["model.layers.1.mlp.gate.weight"]
    embed = [p for p in three.pieces if p.param == "model.embed_tokens.weight"]
    assert [(p.box.start, p.box.size, p.offset) for p in embed] == [((10, 0), (10, 32), (0, 0))]
    held = sum(torch.Size(s).numel() for s in three.local_shapes.values())
    assert held < 0.6 * sum(torch.Size(s).numel() for s in one.local_shapes.values())


def test_non_contiguous_expert_map():
    layout = Layout(dp=2, ep=2)
    emap = [0, 1, 1, 0, 1, 0, 0, 1]
    s = rank_sharding(CFG, layout, 1, expert_map=emap)
    experts = sorted({int(p.param.split(".")[5]) for p in s.pieces if ".experts." in p.param and "layers.1." in p.param})
    assert experts == [1, 2, 4, 7]
    trainer_shard_spec(CFG, layout, expert_map=emap).validate(must_cover=True)


def test_pangu_spec_covers_the_checkpoint_mla_shared_experts_and_mtp():
    from pathlib import Path

    from rlhf.config import load_model_config
    from weight_sync.spec import Box

    pangu = load_model_config(Path(__file__).resolve().parents[4] / "configs" / "model" / "pangu_ultra_moe_718b.yaml")
    spec = trainer_shard_spec(pangu, Layout(pp=4, dp=2, tp=4, ep=2, experts_over_tp_ep=True))
    assert len(spec.ranks) == 32
    boxes = {}  # every checkpoint tensor tiled by distinct boxes (validate() is quadratic at this size)
    for r in spec.ranks:
        for p in r.pieces:
            boxes.setdefault(p.param, set()).add(p.box)
    assert boxes.keys() == spec.shapes().keys()
    for name, shape in spec.shapes().items():
        assert sum(b.numel for b in boxes[name]) == Box.full(shape).numel, name
    last = spec.ranks[-1].buffer_shapes()
    assert last["model.layers.61.mlp.experts.gate_up_proj"] == (256 // 8, 2 * 2048, 7680)  # MTP on the last stage
    assert last["model.layers.61.self_attn.q_b_proj.weight"] == (128 * 192 // 4, 1536)
    assert last["model.layers.61.self_attn.o_proj.weight"] == (7680, 128 * 128 // 4)
