"""Plans refuse what they cannot do exactly, naming the tensor and the ranks; and they are cached."""

import dataclasses

import pytest
import torch

from rlhf.schema import ModelConfig
from rlhf.sharding.trainer import trainer_shard_spec
from weight_sync.apply_local import apply_local
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.plan import Topology, plan_reshard
from weight_sync.spec import Box, Piece, RankShards, ShardSpec

CFG = ModelConfig(vocab_size=6, hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=2)
TOPO = Topology.single_node(4)


def _replace_rank(spec: ShardSpec, rank: int, **changes) -> ShardSpec:
    ranks = tuple(dataclasses.replace(r, **changes) if r.rank == rank else r for r in spec.ranks)
    return dataclasses.replace(spec, ranks=ranks, _index=None)


def test_uncovered_destination_raises_naming_param_and_rank():
    src = trainer_shard_spec(CFG, Layout(tp=2))
    only_rank0 = dataclasses.replace(src, ranks=src.ranks[:1], _index=None)  # q rows 2:4 are nowhere
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: .* rank 2 needs .*"
                                         r"no rank of trainer tp2 holds"):
        plan_reshard(only_rank0, engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=2), TOPO)


def test_missing_tensor_and_shape_mismatch_raise():
    src = trainer_shard_spec(CFG, Layout())
    no_norm = _replace_rank(src, 0, pieces=tuple(p for p in src.ranks[0].pieces if p.param != "model.norm.weight"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: .* holds no piece of it"):
        plan_reshard(no_norm, engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=1), TOPO)
    bigger = engine_shard_spec(dataclasses.replace(CFG, vocab_size=7), InferenceLayout(tp=1), rank_offset=1)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight: .* has global shape \(6, 4\), not \(7, 4\)"):
        plan_reshard(src, bigger, TOPO)


def test_source_region_outside_its_shard_raises():
    src = trainer_shard_spec(CFG, Layout())
    r0 = src.ranks[0]
    bad = tuple(dataclasses.replace(p, offset=(1, 0)) if p.param == "model.embed_tokens.weight" else p for p in r0.pieces)
    with pytest.raises(ValueError, match=r"rank 0: model\.embed_tokens\.weight .* does not fit in buffer"):
        plan_reshard(_replace_rank(src, 0, pieces=bad), engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=1),
                     TOPO)


def test_overlapping_destination_pieces_raise():
    dst = engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=1)
    r = dst.ranks[0]
    # k_proj written over q_proj's rows of the fused qkv buffer: those elements would be written twice
    bad = tuple(dataclasses.replace(p, offset=(0, 0)) if p.param.endswith("k_proj.weight") else p for p in r.pieces)
    with pytest.raises(ValueError, match=r"rank 1: .*q_proj.* and .*k_proj.* overlap in buffer .*qkv_proj"):
        plan_reshard(trainer_shard_spec(CFG, Layout()), _replace_rank(dst, 1, pieces=bad), TOPO)


def test_rank_outside_topology_raises():
    with pytest.raises(ValueError, match="rank 4 is outside topology single_node4"):
        plan_reshard(trainer_shard_spec(CFG, Layout()), engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=4),
                     TOPO)


def test_plans_are_cached_while_specs_do_not_change():
    src, dst = trainer_shard_spec(CFG, Layout(tp=2)), engine_shard_spec(CFG, InferenceLayout(tp=2), rank_offset=2)
    plan = plan_reshard(src, dst, TOPO)
    assert plan_reshard(src, dst, TOPO) is plan
    assert plan_reshard(trainer_shard_spec(CFG, Layout(tp=2)), engine_shard_spec(CFG, InferenceLayout(tp=2),
                                                                                 rank_offset=2), TOPO) is plan
    assert plan_reshard(src, engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=2), TOPO) is not plan


def test_apply_local_names_a_missing_buffer():
    src, dst = trainer_shard_spec(CFG, Layout()), engine_shard_spec(CFG, InferenceLayout(tp=1), rank_offset=1)
    plan = plan_reshard(src, dst, TOPO)
    dst_bufs = {1: {n: torch.zeros(s) for n, s in dst.ranks[0].buffers}}
    with pytest.raises(ValueError, match="no source buffers for rank 0"):
        apply_local(plan, {}, dst_bufs)
    src_bufs = {0: {n: torch.zeros(s) for n, s in src.ranks[0].buffers if n != "model.norm.weight"}}
    with pytest.raises(ValueError, match="source rank 0 has no buffer 'model.norm.weight'"):
        apply_local(plan, src_bufs, dst_bufs)


def test_partially_overlapping_sources_still_cover_exactly_once():
    """A source spec whose boxes overlap without being equal (rank 0: rows 0:3, rank 1: rows 2:6): the
    planner takes each destination element from exactly one of them."""
    shapes = {"w": (6, 2)}
    src = ShardSpec("odd", (("w", (6, 2)),), (
        RankShards(0, (("a", (3, 2)),), (Piece("w", Box((0, 0), (3, 2)), "a", (0, 0)),)),
        RankShards(1, (("b", (4, 2)),), (Piece("w", Box((2, 0), (4, 2)), "b", (0, 0)),))))
    dst = ShardSpec("one", tuple(shapes.items()), (
        RankShards(2, (("w", (6, 2)),), (Piece("w", Box((0, 0), (6, 2)), "w", (0, 0)),)),))
    plan = plan_reshard(src, dst, TOPO)
    full = torch.arange(12.0).reshape(6, 2)
    out = {2: {"w": torch.zeros(6, 2)}}
    apply_local(plan, {0: {"a": full[0:3].clone()}, 1: {"b": full[2:6].clone()}}, out)
    assert torch.equal(out[2]["w"], full) and plan.bytes_minimal == plan.bytes_network == 48
