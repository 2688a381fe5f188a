"""Resharding with some rank pairs declared on one device: their buckets go through shared memory, the rest
over gloo. Bit-exact against the reference, every byte accounted for, corruption in a shared segment caught
and named, segments reused across syncs, and nothing left in /dev/shm after success or failure."""

import os
import time
from pathlib import Path

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.model.hf_io import to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from weight_sync.pieces import local_tensors
from rlhf.parallel.launch import run_ranks
from weight_sync import shm
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.p2p import ChecksumMismatch, run_plan
from weight_sync.plan import Topology, plan_reshard

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "model" / "qwen3_moe_tiny.yaml")


def full_tensors(cfg):
    m = Qwen3MoeForCausalLM(cfg)
    m.init_weights(seed=3, std=0.5)
    return dict(to_hf_tensors(m.state_dict(), cfg))


def worker(rank, src_layout, dst_layout, offset, world, pairs, bucket_bytes, syncs, flip=None, fail_open=None,
           release=None):
    cfg = load_model_config(TINY)
    full = full_tensors(cfg)
    src_spec = trainer_shard_spec(cfg, src_layout)
    dst_spec = engine_shard_spec(cfg, dst_layout, rank_offset=offset)
    plan = plan_reshard(src_spec, dst_spec, Topology.single_node(world))
    src = local_tensors(full, rank_sharding(cfg, src_layout, rank)) if rank < src_layout.world_size else None
    mine = next((r for r in dst_spec.ranks if r.rank == rank), None)
    if fail_open == rank:  # this rank cannot map what its peer created (before unlinking it)
        def refuse(seg_id, nbytes, kind, payload):
            linked = os.path.exists(os.path.join(shm.SHM_DIR, payload.decode()))
            raise OSError(f"injected: cannot map the segment (in /dev/shm: {linked})")
        shm.open_segment = refuse

    def fault(peer, buf):  # the first sync only
        if flip and rank == flip[0] and peer == flip[1] and not out["syncs"] and "mismatch" not in out:
            buf.view(torch.int32)[buf.numel() // 2] ^= 1 << 4

    out = {"syncs": [], "held": []}
    for k in range(syncs):
        if release == rank and k == 1:  # as a restarted receiver: it maps none of its senders' segments
            shm.release_segments()
        dst = {n: torch.full(s, float("nan")) for n, s in mine.buffers} if mine else None
        try:
            stats = run_plan(plan, rank, src, dst, torch.float32, bucket_bytes=bucket_bytes, fault_injector=fault,
                             same_device=pairs)
        except ChecksumMismatch as e:
            out["mismatch"] = str(e)
            out["held"].append(shm.held_segments())
            continue
        except RuntimeError as e:  # a peer that failed: the sync times out here
            out["error"] = str(e)
            return out
        exact = True
        if mine:
            covered = {n: torch.zeros(s, dtype=torch.bool) for n, s in mine.buffers}
            for p in mine.pieces:
                exact &= torch.equal(dst[p.buffer][p.buffer_slices()], full[p.param][p.box.slices()])
                covered[p.buffer][p.buffer_slices()] = True
            exact &= all(dst[n][~c].isnan().all() for n, c in covered.items())  # padding untouched
        out["syncs"].append({"exact": bool(exact), "stats": stats})
        out["held"].append(shm.held_segments())
    out["plan"] = (plan.bytes_minimal, plan.bytes_network, plan.bytes_local)
    out["network_pairs"] = {pair: len(ts) for pair, ts in plan.pairs if pair[0] != pair[1]}
    return out


def ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.NAME_PREFIX)}


CASES = {
    # trainer tp2 on ranks 0-1, a tp2 engine on ranks 2-3; trainer rank r shares a device with engine rank r + 2
    "tp2 -> engine tp2, (0,2) and (1,3) on one device": (Layout(tp=2), InferenceLayout(tp=2), 2, 4, [(0, 2), (1, 3)]),
    # co-located dp2 x ep2 -> ep4 on ranks 0-3; ranks 0 and 1 on one device: shm both ways between them
    "dp2xep2 -> ep4 co-located, (0,1) both ways": (Layout(dp=2, ep=2), InferenceLayout(tp=1, ep=4), 0, 4, [(1, 0)]),
}


@pytest.mark.parametrize("name", CASES)
def test_same_device_pairs_go_through_shared_memory_exactly(name):
    src_layout, dst_layout, offset, world, pairs = CASES[name]
    before = ours()
    results = run_ranks(worker, world, src_layout, dst_layout, offset, world, pairs, 4096, 2, timeout_s=240)
    assert ours() <= before  # nothing left in /dev/shm
    minimal, network, local = results[0]["plan"]
    for k in range(2):  # two syncs in the same processes: the second reuses the segments
        stats = [r["syncs"][k]["stats"] for r in results]
        assert all(r["syncs"][k]["exact"] for r in results)
        shm_bytes, received = sum(s.bytes_shm for s in stats), sum(s.bytes_received for s in stats)
        assert shm_bytes > 0 and received > 0  # both paths used
        assert shm_bytes + received + sum(s.bytes_local for s in stats) == minimal
        assert shm_bytes + received == network
        assert sum(s.bytes_shm_sent for s in stats) == shm_bytes
        assert sum(s.bytes_sent for s in stats) == received
        assert sum(s.checked_transfers for s in stats) == sum(results[0]["network_pairs"].values())
    for r in results:
        assert r["held"][0] == r["held"][1]  # same segment ids: reused, not created again
    held = {(k[1], k[2]) if k[0] == "send" else (k[2], k[1]) for r in results for k in r["held"][0]}
    assert held == shm.pair_set(pairs) & set(results[0]["network_pairs"])  # one per shared pair, each side


def test_corrupted_shared_bucket_is_caught_and_named():
    src_layout, dst_layout, offset, world, pairs = CASES["tp2 -> engine tp2, (0,2) and (1,3) on one device"]
    before = ours()
    results = run_ranks(worker, world, src_layout, dst_layout, offset, world, pairs, 1 << 20, 2, (3, 1),
                        timeout_s=240)
    assert ours() <= before
    msg = results[3]["mismatch"]
    assert "on rank 3 differs from what rank 1 sent through shared memory" in msg and "in buffer" in msg
    assert msg.startswith("weight sync: model.") or msg.startswith("weight sync: lm_head")  # names the tensor
    assert all("mismatch" not in r for r in results[:3])
    assert [len(r["syncs"]) for r in results] == [2, 2, 2, 1]
    assert results[3]["syncs"][0]["exact"]  # the next sync, through the same segment, is exact again


def test_nothing_left_in_dev_shm_when_the_receiver_cannot_map():
    src_layout, dst_layout, offset, world, pairs = CASES["tp2 -> engine tp2, (0,2) and (1,3) on one device"]
    before = ours()
    with pytest.raises(RuntimeError, match=r"injected: cannot map the segment \(in /dev/shm: True\)"):
        run_ranks(worker, world, src_layout, dst_layout, offset, world, pairs, 1 << 20, 1, None, 3,
                  timeout_s=120, collective_timeout_s=5)
    assert ours() <= before


def test_a_receiver_that_lost_its_segment_gets_a_new_one_with_the_first_bucket_moved():
    """The sender packs bucket 0 into the segment kept from the last sync before the receiver's hello says
    whether it still maps it; a receiver that does not (restarted) gets a new segment holding that bucket."""
    src_layout, dst_layout, offset, world, pairs = CASES["tp2 -> engine tp2, (0,2) and (1,3) on one device"]
    before = ours()
    results = run_ranks(worker, world, src_layout, dst_layout, offset, world, pairs, 4096, 3, None, None, 3,
                        timeout_s=240)
    assert ours() <= before
    assert all(sync["exact"] for r in results for sync in r["syncs"]) and [len(r["syncs"]) for r in results] == [3] * 4
    assert all(sync["stats"].bytes_shm > 0 for sync in results[3]["syncs"])  # still through shared memory
    sent, got = [h[("send", 1, 3)] for h in results[1]["held"]], [h[("recv", 3, 1)] for h in results[3]["held"]]
    assert sent[0] != sent[1] == sent[2] and got == sent  # replaced once, then reused; both sides agree
    assert [h[("send", 0, 2)] for h in results[0]["held"]] == [results[0]["held"][0][("send", 0, 2)]] * 3


def posted_worker(rank, src_layout, dst_layout, offset, world, pairs, delay_s, wait_s, announces=True):
    """Receivers wait for their senders' announcement before `run_plan`, as engines posted during the trainer's
    update do; senders start `delay_s` later (past the group's own timeout), announcing themselves."""
    import time

    from weight_sync.p2p import announce, await_senders

    cfg = load_model_config(TINY)
    full = full_tensors(cfg)
    plan = plan_reshard(trainer_shard_spec(cfg, src_layout), engine_shard_spec(cfg, dst_layout, rank_offset=offset),
                        Topology.single_node(world))
    t0 = time.time()
    if rank < src_layout.world_size:
        time.sleep(delay_s)
        if not announces:
            return {}
        if announces == "nothing":  # its update failed: the receivers stop waiting at once
            for w in announce(plan, rank, starts=False):
                w.wait()
            return {}
        go = announce(plan, rank)
        run_plan(plan, rank, local_tensors(full, rank_sharding(cfg, src_layout, rank)), None, torch.float32,
                 same_device=pairs)
        for w in go:
            w.wait()
        return {}
    mine = next(r for r in engine_shard_spec(cfg, dst_layout, rank_offset=offset).ranks if r.rank == rank)
    dst = {n: torch.zeros(s) for n, s in mine.buffers}
    waited = await_senders(plan, rank, timeout_s=wait_s) - t0
    run_plan(plan, rank, None, dst, torch.float32, same_device=pairs)
    exact = all(torch.equal(dst[p.buffer][p.buffer_slices()], full[p.param][p.box.slices()]) for p in mine.pieces)
    return {"exact": exact, "waited": waited}


def test_a_receive_posted_before_its_senders_waits_past_the_group_timeout_and_is_exact():
    """Engines posted while the trainer still updates wait for it longer than the group's timeout (2 s here),
    then receive exactly; a sender that never starts fails the wait after its own limit, naming the rank."""
    src_layout, dst_layout, offset, world, pairs = CASES["tp2 -> engine tp2, (0,2) and (1,3) on one device"]
    before = ours()
    results = run_ranks(posted_worker, world, src_layout, dst_layout, offset, world, pairs, 3.0, 60.0,
                        timeout_s=120, collective_timeout_s=2)
    assert all(r["exact"] and r["waited"] >= 2.5 for r in results[2:])
    with pytest.raises(RuntimeError, match=r"rank [23] waited 1 s for rank [01] to start sending"):
        run_ranks(posted_worker, world, src_layout, dst_layout, offset, world, pairs, 4.0, 1.0, False,
                  timeout_s=60, collective_timeout_s=30)
    t0 = time.monotonic()  # senders whose update failed say so: the receivers stop long before their 60 s
    with pytest.raises(RuntimeError, match=r"rank [01] sends nothing \(its update did not finish\); rank [23] keeps"):
        run_ranks(posted_worker, world, src_layout, dst_layout, offset, world, pairs, 0.5, 60.0, "nothing",
                  timeout_s=60, collective_timeout_s=30)
    assert time.monotonic() - t0 < 30
    assert ours() <= before
