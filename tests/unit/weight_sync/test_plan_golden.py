"""Golden plans on a one-layer model, written out as data: one line per transfer,
"src_rank src_buffer@offset -> dst_rank dst_buffer@offset  param[global region]  [local]"."""

from rlhf.schema import ModelConfig
from rlhf.sharding.trainer import trainer_shard_spec
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.plan import Plan, Topology, plan_reshard

# H=4, 2 heads of 2 (2 KV heads), 2 experts of FFN 2, vocabulary 6 (engines pad it to 64 rows).
CFG = ModelConfig(name="golden", vocab_size=6, hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=2)


def _short(name: str) -> str:
    return name.replace("model.layers.0.", "").replace("model.", "").replace(".weight", "")


def lines(plan: Plan, only: str = "") -> list[str]:
    out = []
    for t in plan.transfers():
        if only in t.param:
            region = ",".join(f"{a}:{a + n}" for a, n in zip(t.box.start, t.box.size))
            out.append(f"{t.src} {_short(t.src_buffer)}@{t.src_offset} -> {t.dst} {_short(t.dst_buffer)}@{t.dst_offset}  "
                       f"{_short(t.param)}[{region}]" + ("  local" if t.local else ""))
    return out


def test_tp2_trainer_to_colocated_tp1_engine():
    """Rank 0 is trainer TP rank 0 and the engine: its half of each split tensor and every replicated tensor
    are local copies; rank 1 sends the other halves into the fused qkv rows and the o_proj columns."""
    plan = plan_reshard(trainer_shard_spec(CFG, Layout(tp=2)), engine_shard_spec(CFG, InferenceLayout(tp=1)),
                        Topology.single_node(2))
    assert lines(plan) == [
        "0 embed_tokens@(0, 0) -> 0 embed_tokens@(0, 0)  embed_tokens[0:6,0:4]  local",
        "0 input_layernorm@(0,) -> 0 input_layernorm@(0,)  input_layernorm[0:4]  local",
        "0 self_attn.q_proj@(0, 0) -> 0 self_attn.qkv_proj@(0, 0)  self_attn.q_proj[0:2,0:4]  local",
        "0 self_attn.k_proj@(0, 0) -> 0 self_attn.qkv_proj@(4, 0)  self_attn.k_proj[0:2,0:4]  local",
        "0 self_attn.v_proj@(0, 0) -> 0 self_attn.qkv_proj@(8, 0)  self_attn.v_proj[0:2,0:4]  local",
        "0 self_attn.o_proj@(0, 0) -> 0 self_attn.o_proj@(0, 0)  self_attn.o_proj[0:4,0:2]  local",
        "0 self_attn.q_norm@(0,) -> 0 self_attn.q_norm@(0,)  self_attn.q_norm[0:2]  local",
        "0 self_attn.k_norm@(0,) -> 0 self_attn.k_norm@(0,)  self_attn.k_norm[0:2]  local",
        "0 post_attention_layernorm@(0,) -> 0 post_attention_layernorm@(0,)  post_attention_layernorm[0:4]  local",
        "0 mlp.gate@(0, 0) -> 0 mlp.gate@(0, 0)  mlp.gate[0:2,0:4]  local",
        "0 mlp.experts.gate_up_proj@(0, 0, 0) -> 0 mlp.experts.w13_weight@(0, 0, 0)  mlp.experts.0.gate_proj[0:2,0:4]  local",
        "0 mlp.experts.gate_up_proj@(0, 2, 0) -> 0 mlp.experts.w13_weight@(0, 2, 0)  mlp.experts.0.up_proj[0:2,0:4]  local",
        "0 mlp.experts.down_proj@(0, 0, 0) -> 0 mlp.experts.w2_weight@(0, 0, 0)  mlp.experts.0.down_proj[0:4,0:2]  local",
        "0 mlp.experts.gate_up_proj@(1, 0, 0) -> 0 mlp.experts.w13_weight@(1, 0, 0)  mlp.experts.1.gate_proj[0:2,0:4]  local",
        "0 mlp.experts.gate_up_proj@(1, 2, 0) -> 0 mlp.experts.w13_weight@(1, 2, 0)  mlp.experts.1.up_proj[0:2,0:4]  local",
        "0 mlp.experts.down_proj@(1, 0, 0) -> 0 mlp.experts.w2_weight@(1, 0, 0)  mlp.experts.1.down_proj[0:4,0:2]  local",
        "0 norm@(0,) -> 0 norm@(0,)  norm[0:4]  local",
        "0 lm_head@(0, 0) -> 0 lm_head@(0, 0)  lm_head[0:6,0:4]  local",
        "1 self_attn.q_proj@(0, 0) -> 0 self_attn.qkv_proj@(2, 0)  self_attn.q_proj[2:4,0:4]",
        "1 self_attn.k_proj@(0, 0) -> 0 self_attn.qkv_proj@(6, 0)  self_attn.k_proj[2:4,0:4]",
        "1 self_attn.v_proj@(0, 0) -> 0 self_attn.qkv_proj@(10, 0)  self_attn.v_proj[2:4,0:4]",
        "1 self_attn.o_proj@(0, 0) -> 0 self_attn.o_proj@(0, 2)  self_attn.o_proj[0:4,2:4]",
    ]
    # 184 elements of float32; the four halves rank 1 sends are 8 elements each.
    assert (plan.bytes_minimal, plan.bytes_local, plan.bytes_network) == (736, 608, 128)
    assert plan.send_bytes == ((1, 128),) and plan.recv_bytes == ((0, 128),)


def test_expert_maps_on_both_sides_and_balanced_replicas():
    """Trainer dp2 x ep2 with experts swapped (expert 0 on rank 1) -> one engine tp1 x ep2 on ranks 2, 3
    (default map: expert e on engine rank 2 + e). Each expert has one source; the replicated tensors
    (held by both trainer ranks) are spread so the two senders carry equal bytes."""
    src = trainer_shard_spec(CFG, Layout(dp=2, ep=2), expert_map=[1, 0])
    dst = engine_shard_spec(CFG, InferenceLayout(tp=1, ep=2), rank_offset=2)
    plan = plan_reshard(src, dst, Topology.single_node(4))
    assert lines(plan, only=".experts.") == [
        "0 mlp.experts.gate_up_proj@(0, 0, 0) -> 3 mlp.experts.w13_weight@(0, 0, 0)  mlp.experts.1.gate_proj[0:2,0:4]",
        "0 mlp.experts.gate_up_proj@(0, 2, 0) -> 3 mlp.experts.w13_weight@(0, 2, 0)  mlp.experts.1.up_proj[0:2,0:4]",
        "0 mlp.experts.down_proj@(0, 0, 0) -> 3 mlp.experts.w2_weight@(0, 0, 0)  mlp.experts.1.down_proj[0:4,0:2]",
        "1 mlp.experts.gate_up_proj@(0, 0, 0) -> 2 mlp.experts.w13_weight@(0, 0, 0)  mlp.experts.0.gate_proj[0:2,0:4]",
        "1 mlp.experts.gate_up_proj@(0, 2, 0) -> 2 mlp.experts.w13_weight@(0, 2, 0)  mlp.experts.0.up_proj[0:2,0:4]",
        "1 mlp.experts.down_proj@(0, 0, 0) -> 2 mlp.experts.w2_weight@(0, 0, 0)  mlp.experts.0.down_proj[0:4,0:2]",
    ]
    # each engine rank receives the whole non-expert model (136 elements) and one expert (24): 160 * 4 bytes
    assert plan.recv_bytes == ((2, 640), (3, 640)) and plan.send_bytes == ((0, 640), (1, 640))
    assert plan.bytes_local == 0 and plan.bytes_network == plan.bytes_minimal == 1280


def test_same_node_replica_preferred():
    """Trainer dp2 on ranks 0 (node 0) and 1 (node 1); two tp1 engines on ranks 2 (node 0) and 3 (node 1):
    each engine reads everything from the replica on its own node."""
    two_nodes = Topology("two_nodes", (0, 1, 0, 1), 1e9)
    plan = plan_reshard(trainer_shard_spec(CFG, Layout(dp=2)),
                        engine_shard_spec(CFG, InferenceLayout(tp=1, engines=2), rank_offset=2), two_nodes)
    assert sorted(plan.by_pair()) == [(0, 2), (1, 3)]
    assert plan.floor_seconds(two_nodes) == 736 / 1e9
