"""Co-located weight sync on one accelerator: a trainer TP 2 and an engine TP 2, all four ranks on one GPU,
every pair declared on one device. The buckets go through device memory shared by IPC handle, the handshakes
and checksums over the transfer group's gloo side, and the nccl group itself carries nothing (nccl refuses
two ranks on one GPU). Bit-exact over two syncs (the second reuses the segments), and a bucket corrupted in
the shared slot is caught and named. Skipped without an accelerator; run it as tests/dist/test_device_trainer.py
says."""

from __future__ import annotations

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from rlhf.parallel.comm import backend_for
from rlhf.parallel.launch import free_port, run_ranks
from tests.dist.test_device_trainer import DEVICE
from tests.dist.test_weight_sync_shm import TINY, full_tensors
from weight_sync import shm
from weight_sync.group import transfer_group
from weight_sync.p2p import ChecksumMismatch, run_plan
from weight_sync.pieces import local_tensors
from weight_sync.plan import Topology, plan_reshard

pytestmark = pytest.mark.skipif(DEVICE is None, reason="no CUDA or Ascend device here")
PAIRS = [(0, 2), (0, 3), (1, 2), (1, 3)]  # trainer ranks 0-1, engine ranks 2-3: every pair on the one device


def worker(rank, port, flip):
    cfg = load_model_config(TINY)
    full = full_tensors(cfg)
    src_layout, world = Layout(tp=2), 4
    dst_spec = engine_shard_spec(cfg, InferenceLayout(tp=2), rank_offset=2)
    plan = plan_reshard(trainer_shard_spec(cfg, src_layout), dst_spec, Topology.single_node(world))
    src = None
    if rank < 2:
        src = {n: t.to(DEVICE) for n, t in local_tensors(full, rank_sharding(cfg, src_layout, rank)).items()}
    mine = next((r for r in dst_spec.ranks if r.rank == rank), None)
    group = transfer_group(backend_for(DEVICE), "127.0.0.1", port, rank, world, 60)
    out = {"syncs": [], "held": []}

    def fault(peer, buf):  # the first sync only
        if flip and rank == flip[0] and peer == flip[1] and not out["syncs"] and "mismatch" not in out:
            buf.view(torch.int32)[buf.numel() // 2] ^= 1 << 4

    try:
        for _ in range(2):
            dst = {n: torch.full(s, float("nan"), device=DEVICE) for n, s in mine.buffers} if mine else None
            try:
                stats = run_plan(plan, rank, src, dst, torch.float32, group=group, bucket_bytes=4096,
                                 fault_injector=fault, same_device=PAIRS)
            except ChecksumMismatch as e:
                out["mismatch"] = str(e)
                continue
            exact = all(torch.equal(dst[p.buffer][p.buffer_slices()].cpu(), full[p.param][p.box.slices()])
                        for p in mine.pieces) if mine else True
            out["syncs"].append({"exact": exact, "shm": stats.bytes_shm, "net": stats.bytes_received,
                                 "checked": stats.checked_transfers})
            out["held"].append(shm.held_segments())
        out["segment_devices"] = sorted({s.data.device.type for s in shm._HELD.values()})
    finally:
        shm.release_segments()
        group.close()
    return out


def test_colocated_sync_through_device_ipc_is_exact():
    results = run_ranks(worker, 4, free_port(), None, timeout_s=240, device_type=DEVICE, backend="gloo")
    for k in range(2):
        assert all(r["syncs"][k]["exact"] for r in results)
        assert sum(r["syncs"][k]["shm"] for r in results) > 0 and sum(r["syncs"][k]["net"] for r in results) == 0
        assert sum(r["syncs"][k]["checked"] for r in results) > 0
    assert all(r["held"][0] == r["held"][1] for r in results)  # the second sync reused the segments
    assert all(r["segment_devices"] == [DEVICE] for r in results)


def test_corrupted_device_bucket_is_caught_and_named():
    results = run_ranks(worker, 4, free_port(), (3, 1), timeout_s=240, device_type=DEVICE, backend="gloo")
    msg = results[3]["mismatch"]
    assert "on rank 3 differs from what rank 1 sent through shared memory" in msg, msg
    assert all("mismatch" not in r for r in results[:3])
    assert [len(r["syncs"]) for r in results] == [2, 2, 2, 1]
    assert results[3]["syncs"][0]["exact"]  # the next sync, through the same segment, is exact again


def _group_launch(rank, port):
    from weight_sync.p2p import _Batch

    group = transfer_group(backend_for(DEVICE), "127.0.0.1", port, rank, 1, 60)
    try:
        with _Batch(group, torch.device(DEVICE)) as batch:  # the backend's own coalescing calls, no operation
            pass
        return batch.backend is not None
    finally:
        group.close()


def test_device_group_launch_opens_and_closes():
    """The point-to-point rounds of a device backend run as one group launch (`_Batch`): its calls exist with
    the arguments given (one GPU holds one nccl rank, so no transfer crosses it here)."""
    assert run_ranks(_group_launch, 1, free_port(), timeout_s=120, device_type=DEVICE) == [True]
