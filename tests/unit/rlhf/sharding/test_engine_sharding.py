"""The engines' spec mirrors vLLM's buffers: names, shapes, fused row order, KV head groups, vocabulary
padding, expert placement, attention-DP replicas, rank numbering; and errors name the clashing degrees."""

from pathlib import Path

import pytest

from rlhf.config import load_model_config
from rlhf.schema import Attention, MLAConfig, ModelConfig, RouterScoring
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout
from weight_sync.spec import Box, Piece

MODELS = Path(__file__).resolve().parents[4] / "configs" / "model"

CFG = ModelConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4,
                  first_k_dense_layers=1, intermediate_size=8)
MLA = ModelConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  head_dim=4, attention=Attention.mla,
                  mla=MLAConfig(q_lora_rank=4, kv_lora_rank=4, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=2),
                  num_experts=4, moe_intermediate_size=4, num_shared_experts=1, shared_expert_intermediate_size=4,
                  router_scoring=RouterScoring.sigmoid, first_k_dense_layers=1, intermediate_size=8, num_mtp_layers=1)


def test_layout_errors_name_the_clash():
    with pytest.raises(ValueError, match="ep must be 1 or a multiple of tp"):
        InferenceLayout(tp=4, ep=6)
    with pytest.raises(ValueError, match="engines=0"):
        InferenceLayout(tp=1, engines=0)
    with pytest.raises(ValueError, match="tp=3 must divide the 4 attention heads"):
        engine_shard_spec(CFG, InferenceLayout(tp=3))
    with pytest.raises(ValueError, match="ep=8 must divide the 4 experts"):
        engine_shard_spec(CFG, InferenceLayout(tp=1, ep=8))
    with pytest.raises(ValueError, match="equal counts|unequal"):
        engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2), expert_map=[0, 0, 0, 1])
    assert InferenceLayout(tp=4, ep=8, engines=12).world_size == 96
    assert InferenceLayout(tp=4, ep=8).attention_dp == 2 and InferenceLayout(tp=4).ranks_per_engine == 4


def test_qwen3_30b_buffers_have_vllm_shapes():
    cfg = load_model_config(MODELS / "qwen3_30b_a3b.yaml")
    spec = engine_shard_spec(cfg, InferenceLayout(tp=4))
    bufs = spec.ranks[1].buffer_shapes()
    p = "model.layers.0"
    assert bufs[f"{p}.self_attn.qkv_proj.weight"] == ((32 // 4 + 2 * 4 // 4) * 128, 2048)
    assert bufs[f"{p}.self_attn.o_proj.weight"] == (2048, 32 * 128 // 4)
    assert bufs[f"{p}.mlp.experts.w13_weight"] == (128, 2 * 768 // 4, 2048)
    assert bufs[f"{p}.mlp.experts.w2_weight"] == (128, 2048, 768 // 4)
    assert bufs["model.embed_tokens.weight"] == (151936 // 4, 2048)  # 151936 is a multiple of 64
    assert bufs[f"{p}.mlp.gate.weight"] == (128, 2048) and bufs[f"{p}.self_attn.q_norm.weight"] == (128,)
    ep = engine_shard_spec(cfg, InferenceLayout(tp=2, ep=8)).ranks[5].buffer_shapes()
    assert ep[f"{p}.mlp.experts.w13_weight"] == (16, 2 * 768, 2048)  # whole experts, 128 / 8 per rank


def test_fused_rows_order_and_kv_head_groups():
    spec = engine_shard_spec(CFG, InferenceLayout(tp=4))  # 4 ranks > 2 KV heads: heads replicated by group
    for r in spec.ranks:
        t = r.rank
        qkv = {p.param.rsplit(".", 2)[1]: p for p in r.pieces if p.buffer.endswith("qkv_proj.weight") and "layers.0" in p.buffer}
        assert qkv["q_proj"] == Piece("model.layers.0.self_attn.q_proj.weight", Box((2 * t, 0), (2, 8)),
                                      "model.layers.0.self_attn.qkv_proj.weight", (0, 0))
        head = t * 2 // 4
        assert qkv["k_proj"].box == Box((2 * head, 0), (2, 8)) and qkv["k_proj"].offset == (2, 0)
        assert qkv["v_proj"].box == Box((2 * head, 0), (2, 8)) and qkv["v_proj"].offset == (4, 0)
        gate_up = sorted((p.offset, p.param, p.box) for p in r.pieces if p.buffer == "model.layers.0.mlp.gate_up_proj.weight")
        assert gate_up == [((0, 0), "model.layers.0.mlp.gate_proj.weight", Box((2 * t, 0), (2, 8))),
                           ((2, 0), "model.layers.0.mlp.up_proj.weight", Box((2 * t, 0), (2, 8)))]
        w13 = {(p.param, p.offset) for p in r.pieces if p.buffer == "model.layers.1.mlp.experts.w13_weight"}
        assert ("model.layers.1.mlp.experts.3.up_proj.weight", (3, 1, 0)) in w13  # I_local = 1: up at row 1


def test_vocab_padding_rows_are_uncovered():
    spec = engine_shard_spec(CFG, InferenceLayout(tp=4))  # 40 -> 64 rows, 16 per rank
    rows = {}
    for r in spec.ranks:
        assert r.buffer_shapes()["lm_head.weight"] == (16, 8)
        rows[r.rank] = [p.box for p in r.pieces if p.param == "lm_head.weight"]
    assert rows == {0: [Box((0, 0), (16, 8))], 1: [Box((16, 0), (16, 8))], 2: [Box((32, 0), (8, 8))], 3: []}


def test_expert_parallel_engines_replicate_attention_and_split_experts_by_map():
    emap = [1, 0, 0, 1]  # experts 1, 2 on ep rank 0; 0, 3 on ep rank 1
    spec = engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2, engines=2), rank_offset=5, expert_map=emap)
    assert spec.rank_ids() == (5, 6, 7, 8)
    spec.validate(must_cover=True)
    experts = {r.rank: sorted({p.param.split(".")[5] for p in r.pieces if ".experts." in p.param}) for r in spec.ranks}
    assert experts == {5: ["1", "2"], 6: ["0", "3"], 7: ["1", "2"], 8: ["0", "3"]}
    attn = [{p for p in r.pieces if "self_attn" in p.param} for r in spec.ranks]
    assert attn[0] == attn[1] == attn[2] == attn[3]  # tp=1 attention, replicated over the DP-attention ranks


def slots(rank, layer):
    """Logical expert in each local slot of `rank`'s w13 buffer of `layer`, from its gate pieces."""
    out = {}
    for p in rank.pieces:
        if p.param.startswith(f"model.layers.{layer}.mlp.experts.") and p.param.endswith("gate_proj.weight"):
            out[p.offset[0]] = int(p.param.split(".")[5])
    return [out[j] for j in range(len(out))]


def test_redundant_experts_follow_vllm_eplb():
    # 4 experts + 2 redundant over ep=2: 3 physical slots per rank; vLLM's initial map repeats experts 0, 1
    spec = engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2, redundant_experts=2))
    spec.validate(must_cover=True)
    r0, r1 = spec.ranks
    assert r0.buffer_shapes()["model.layers.1.mlp.experts.w13_weight"] == (3, 8, 8)
    assert slots(r0, 1) == [0, 1, 2] and slots(r1, 1) == [3, 0, 1]
    assert str(InferenceLayout(tp=1, ep=2, redundant_experts=2)) == "1x(tp1ep2r2)"
    # an EPLB map per layer (MLA: dense layer 0, MoE layer 1 and the MTP layer 2); expert 2 held three times
    per_layer = {1: [2, 0, 2, 1, 3, 2], 2: [3, 2, 1, 0, 0, 1]}
    spec = engine_shard_spec(MLA, InferenceLayout(tp=1, ep=2, redundant_experts=2), physical_experts=per_layer)
    r0, r1 = spec.ranks
    assert (slots(r0, 1), slots(r1, 1), slots(r0, 2), slots(r1, 2)) == ([2, 0, 2], [1, 3, 2], [3, 2, 1], [0, 0, 1])


def test_redundant_expert_errors_say_what_to_change():
    with pytest.raises(ValueError, match="redundant_experts=2 with ep=1"):
        InferenceLayout(tp=2, redundant_experts=2)
    with pytest.raises(ValueError, match=r"ep=2 must divide the 4 \+ 1 redundant = 5 physical experts"):
        engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2, redundant_experts=1))
    with pytest.raises(ValueError, match="each at least once"):  # expert 3 in no slot
        engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2, redundant_experts=2), physical_experts=[0, 1, 2, 0, 1, 2])
    with pytest.raises(ValueError, match="expected 4 \\+ 2 redundant = 6 slots"):
        engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2, redundant_experts=2), physical_experts=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="give physical_experts"):
        engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2, redundant_experts=2), expert_map=[0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"the MoE layers are \[1, 2\]"):
        engine_shard_spec(MLA, InferenceLayout(tp=1, ep=2), physical_experts={1: [0, 1, 2, 3]})


@pytest.mark.parametrize("cfg", [CFG, MLA], ids=["gqa", "mla"])
@pytest.mark.parametrize("layout", [InferenceLayout(tp=1), InferenceLayout(tp=2), InferenceLayout(tp=4, engines=2),
                                    InferenceLayout(tp=2, ep=4), InferenceLayout(tp=4, ep=4)], ids=str)
def test_every_engine_covers_the_model(cfg, layout):
    spec = engine_shard_spec(cfg, layout)
    spec.validate(must_cover=True)
    W = layout.ranks_per_engine
    for k in range(layout.engines):  # each engine alone holds the whole model
        engine = spec.ranks[k * W:(k + 1) * W]
        held = {p.param for r in engine for p in r.pieces}
        assert held == set(spec.shapes())


def test_mla_buffers_follow_vllm_deepseek():
    bufs = engine_shard_spec(MLA, InferenceLayout(tp=2)).ranks[0].buffer_shapes()
    p = "model.layers.1"
    assert bufs[f"{p}.self_attn.fused_qkv_a_proj.weight"] == (4 + 4 + 2, 8)  # [q_a; kv_a_with_mqa], replicated
    assert bufs[f"{p}.self_attn.q_b_proj.weight"] == (4 * 4 // 2, 4)
    assert bufs[f"{p}.self_attn.kv_b_proj.weight"] == (4 * (2 + 2) // 2, 4)
    assert bufs[f"{p}.self_attn.o_proj.weight"] == (8, 4 * 2 // 2)
    assert bufs[f"{p}.mlp.shared_experts.gate_up_proj.weight"] == (4, 8)
    assert bufs[f"{p}.mlp.gate.e_score_correction_bias"] == (4,)
    assert bufs["model.layers.2.eh_proj.weight"] == (8, 16)  # MTP module
    no_mtp = engine_shard_spec(MLA, InferenceLayout(tp=2), include_mtp=False)
    no_mtp.validate(must_cover=True)
    assert not any(n.startswith("model.layers.2.") for n in no_mtp.shapes())
