"""The planner's trainer spec: the trainer's own spec where it describes the model; for MLA / shared-expert /
MTP shapes a stand-in that applies the same rules and equals the trainer's spec on Qwen3-MoE shapes."""

from pathlib import Path

import pytest

from rlhf.config import load_model_config
from rlhf.config.schema import ModelConfig
from rlhf.model.sharding import trainer_shard_spec
from weight_sync.layout import Layout
from weight_sync.spec import Box
from weight_sync.trainer_spec import stand_in_trainer_spec, trainer_describes, trainer_spec

MODELS = Path(__file__).resolve().parents[3] / "configs" / "model"
CFG = ModelConfig(vocab_size=40, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                  first_k_dense_layers=1, intermediate_size=40)


@pytest.mark.parametrize("layout,emap,split", [
    (Layout(), None, None), (Layout(tp=2), None, None), (Layout(tp=4), None, None),
    (Layout(dp=2, ep=2), [0, 1, 1, 0, 1, 0, 0, 1], None), (Layout(pp=2, tp=2), None, [1, 3]),
    (Layout(pp=2, dp=2, tp=2, ep=2, experts_over_tp_ep=True), None, None)], ids=str)
def test_stand_in_equals_trainer_spec_on_qwen3_shapes(layout, emap, split):
    ours = stand_in_trainer_spec(CFG, layout, emap, split, rank_offset=3)
    theirs = trainer_shard_spec(CFG, layout, emap, split, rank_offset=3)
    assert ours.rank_ids() == theirs.rank_ids() and ours.global_shapes == theirs.global_shapes
    for a, b in zip(ours.ranks, theirs.ranks):
        assert set(a.pieces) == set(b.pieces) and dict(a.buffers) == dict(b.buffers), a.rank
    assert trainer_describes(CFG) and trainer_spec(CFG, layout, emap, split) == trainer_shard_spec(CFG, layout, emap, split)


def test_pangu_needs_the_stand_in_and_it_covers_the_checkpoint():
    pangu = load_model_config(MODELS / "pangu_ultra_moe_718b.yaml")
    assert not trainer_describes(pangu)
    with pytest.raises(ValueError, match="unknown tensor"):  # why the stand-in exists
        trainer_shard_spec(pangu, Layout(pp=61)).validate(must_cover=True)
    spec = stand_in_trainer_spec(pangu, Layout(pp=4, dp=2, tp=4, ep=2, experts_over_tp_ep=True))
    assert len(spec.ranks) == 32
    boxes = {}  # every checkpoint tensor tiled by distinct boxes (validate(must_cover) is slow at this size)
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
