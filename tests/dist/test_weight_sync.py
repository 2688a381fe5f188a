"""Resharding over gloo point-to-point equals the reference bit for bit, and its checksum catches a flipped bit."""

import pytest
import torch

from rlhf.schema import ModelConfig
from rlhf.model.hf_io import to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from weight_sync.pieces import local_tensors
from rlhf.parallel.launch import run_ranks
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.p2p import ChecksumMismatch, run_plan
from weight_sync.plan import Topology, plan_reshard

CFG = ModelConfig(vocab_size=40, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  first_k_dense_layers=1, intermediate_size=48)


def full_tensors():
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=3, std=0.5)
    return dict(to_hf_tensors(m.state_dict(), CFG))


def worker(rank, src_layout, emap, dst_layout, offset, world, bucket_bytes, flip, zero_stage=1, alone_bytes=256 << 10):
    full = full_tensors()
    src_spec = trainer_shard_spec(CFG, src_layout, emap, zero_stage=zero_stage)
    dst_spec = engine_shard_spec(CFG, dst_layout, rank_offset=offset)
    plan = plan_reshard(src_spec, dst_spec, Topology.single_node(world))
    src = (local_tensors(full, rank_sharding(CFG, src_layout, rank, emap, zero_stage=zero_stage))
           if rank < src_layout.world_size else None)
    mine = [r for r in dst_spec.ranks if r.rank == rank]
    dst = {n: torch.full(s, float("nan")) for n, s in mine[0].buffers} if mine else None

    def fault(peer, buf):
        if flip and rank == flip[0] and peer == flip[1]:
            buf.view(torch.int32)[buf.numel() // 2] ^= 1 << 4

    try:
        stats = run_plan(plan, rank, src, dst, torch.float32, bucket_bytes=bucket_bytes, fault_injector=fault,
                         alone_bytes=alone_bytes)
    except ChecksumMismatch as e:
        return {"mismatch": str(e)}
    exact = True
    if mine:
        covered = {n: torch.zeros(s, dtype=torch.bool) for n, s in mine[0].buffers}
        for p in mine[0].pieces:
            exact &= torch.equal(dst[p.buffer][p.buffer_slices()], full[p.param][p.box.slices()])
            covered[p.buffer][p.buffer_slices()] = True
        exact &= all(dst[n][~c].isnan().all() for n, c in covered.items())  # padding untouched
    return {"exact": exact, "stats": stats, "plan": (plan.bytes_minimal, plan.bytes_network, plan.bytes_local)}


CASES = {
    "disaggregated tp2 -> tp2": (Layout(tp=2), None, InferenceLayout(tp=2), 2, 4),
    "co-located pp2xtp2 -> ep4": (Layout(pp=2, tp=2), None, InferenceLayout(tp=1, ep=4), 0, 4),
    "ep2 non-contiguous -> 2 engines": (Layout(dp=2, ep=2), [1, 0, 0, 1, 1, 0, 1, 0], InferenceLayout(tp=1, engines=2),
                                        2, 4),
    "tp2 -> tp2 x ep4 (dp attention) co-located": (Layout(dp=2, tp=2, ep=2), None, InferenceLayout(tp=2, ep=4), 0, 4),
    # zero_stage=3: each DP rank owns its rows (experts: whole experts per replica) and sends them itself
    "zero3 dp4xep2 -> tp2 co-located": (Layout(dp=4, ep=2), None, InferenceLayout(tp=2), 0, 4, 3),
}


@pytest.mark.parametrize("name", CASES)
def test_p2p_reshard_is_exact(name):
    """4 KiB buckets; transfers of 2 KiB or more travel alone, in place where their regions are contiguous."""
    src_layout, emap, dst_layout, offset, world, zero = (*CASES[name], 1)[:6]
    results = run_ranks(worker, world, src_layout, emap, dst_layout, offset, world, 4096, None, zero, 2048,
                        timeout_s=180)
    assert all(r["exact"] for r in results)
    if zero == 3:  # every trainer rank sends: the row shards have one owner each
        assert all(r["stats"].bytes_sent + r["stats"].bytes_local > 0 for r in results[:src_layout.world_size])
    minimal, network, local = results[0]["plan"]
    received = sum(r["stats"].bytes_received for r in results)
    assert received == network and 0 < sum(r["stats"].bytes_in_place for r in results) <= received
    assert sum(r["stats"].bytes_local for r in results) == local and network + local == minimal
    assert sum(r["stats"].buckets_sent for r in results) > len({r["stats"].bytes_sent for r in results})  # bucketed


def test_checksum_names_the_corrupted_tensor_and_ranks():
    src_layout, emap, dst_layout, offset, world = CASES["disaggregated tp2 -> tp2"]
    results = run_ranks(worker, world, src_layout, emap, dst_layout, offset, world, 1 << 20, (3, 1), timeout_s=180)
    msg = results[3]["mismatch"]
    assert "on rank 3 differs from what rank 1 sent (1 block(s) of 4 KiB differ)" in msg
    assert all("mismatch" not in r for r in results[:3])
    # the flipped float is element n // 2 of the pair's single bucket: its tensor and region are named
    plan = plan_reshard(trainer_shard_spec(CFG, src_layout), engine_shard_spec(CFG, dst_layout, rank_offset=offset),
                        Topology.single_node(world))
    transfers = dict(plan.pairs)[(1, 3)]
    n = sum(t.numel for t in transfers)
    assert n * 4 <= 1 << 20
    start = 0
    for t in transfers:
        if start <= n // 2 < start + t.numel:
            assert f"{t.param} region {t.box} in buffer {t.dst_buffer!r}" in msg
            break
        start += t.numel
    else:
        raise AssertionError("flipped element outside the bucket")


def test_checksum_covers_transfers_received_in_place():
    """Every transfer a message of its own, received straight into the engine's buffer: a bit flipped in
    each of rank 1's messages to rank 3 is caught, and the first one named."""
    src_layout, emap, dst_layout, offset, world = CASES["disaggregated tp2 -> tp2"]
    results = run_ranks(worker, world, src_layout, emap, dst_layout, offset, world, 1 << 20, (3, 1), 1, 0,
                        timeout_s=180)
    plan = plan_reshard(trainer_shard_spec(CFG, src_layout), engine_shard_spec(CFG, dst_layout, rank_offset=offset),
                        Topology.single_node(world))
    first = dict(plan.pairs)[(1, 3)][0]
    msg = results[3]["mismatch"]
    assert msg.startswith(f"weight sync: {first.param} region {first.box} in buffer {first.dst_buffer!r} on rank 3")
    assert all("mismatch" not in r for r in results[:3])
