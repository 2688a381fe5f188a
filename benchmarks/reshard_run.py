"""The measured half of `python -m benchmarks.reshard_bench` (without --simulate): the plan run over real gloo
processes on this machine, beside its floor and the gather-then-broadcast baseline, in one run.

One process per rank of the transfer world (trainer ranks 0..N-1; engine ranks from the offset, so
offset 0 co-locates them with the first trainer ranks). Each process builds the same seeded model,
holds its trainer shards (`local_tensors`) and its engine buffers (engine spec, NaN-filled so that
untouched padding is visible), and times side by side, after a warm-up, the best of `repeats` runs of:
- `sync`: `run_plan` (bucketed point-to-point, checksum on), and the same without the checksum;
- `floor`: one contiguous buffer per (src, dst) pair with exactly the plan's network bytes, isend /
  irecv all at once, no slicing, no copy-in: what the transport itself costs on these processes;
- `baseline`: what verl / slime / OpenRLHF do: every tensor gathered whole on rank 0 from one owner
  of each region, broadcast to every rank in buckets, and each engine rank slicing its part.
Every engine buffer is checked against the reference bit for bit after a sync and after a baseline run.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from rlhf.schema import ModelConfig
from rlhf.model.hf_io import to_hf_tensors, torch_dtype
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from weight_sync.pieces import local_tensors
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.p2p import run_plan
from weight_sync.plan import Plan, Topology, plan_reshard


def _timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best over `repeats` of each function's slowest rank, the functions run side by side in every
    repeat (this machine's speed drifts between runs), after one warm-up of each."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            best[name] = min(best[name], float(elapsed))
    return best


def _raw_exchange(plan: Plan, rank: int, dtype: torch.dtype) -> None:
    works, bufs = [], []
    for (s, d), transfers in plan.pairs:
        if s == d or rank not in (s, d):
            continue
        n = sum(t.numel for t in transfers)
        buf = torch.empty(n, dtype=dtype) if rank == d else torch.ones(n, dtype=dtype)
        works.append(dist.irecv(buf, src=s) if rank == d else dist.isend(buf, dst=d))
        bufs.append(buf)
    for w in works:
        w.wait()


def _baseline(full_shapes, src_spec, dst_pieces, rank, src, dst, dtype, bucket_bytes) -> None:
    """Gather each tensor whole on rank 0 (one owner per region), broadcast buckets to every rank,
    then each engine rank copies its slices."""
    owners = {}
    for r in src_spec.ranks:
        for p in r.pieces:
            owners.setdefault((p.param, p.box), (r.rank, p))
    names = list(full_shapes)
    elem = torch.empty((), dtype=dtype).element_size()
    start = 0
    while start < len(names):
        bucket, size = [], 0
        while start < len(names) and (not bucket or size + _numel(full_shapes[names[start]]) * elem <= bucket_bytes):
            bucket.append(names[start])
            size += _numel(full_shapes[names[start]]) * elem
            start += 1
        flat = torch.empty(size // elem, dtype=dtype)
        views, off = {}, 0
        for n in bucket:
            views[n] = flat[off:off + _numel(full_shapes[n])].view(full_shapes[n])
            off += _numel(full_shapes[n])
        works = []
        for (param, box), (owner, p) in owners.items():
            if param not in views:
                continue
            if owner == rank == 0:
                views[param][box.slices()].copy_(src[p.buffer][p.buffer_slices()])
            elif owner == rank:
                works.append(dist.isend(src[p.buffer][p.buffer_slices()].contiguous(), dst=0))
            elif rank == 0:
                part = torch.empty(box.size, dtype=dtype)
                works.append((dist.irecv(part, src=owner), views[param], box, part))
        for w in works:
            if isinstance(w, tuple):
                w[0].wait()
                w[1][w[2].slices()].copy_(w[3])
            else:
                w.wait()
        dist.broadcast(flat, src=0)
        for p in dst_pieces:
            if p.param in views:
                dst[p.buffer][p.buffer_slices()].copy_(views[p.param][p.box.slices()])


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def worker(rank: int, cfg: ModelConfig, src_layout: Layout, dst_layout: InferenceLayout, offset: int, world: int,
           bucket_bytes: int, repeats: int) -> dict:
    dtype = torch_dtype(cfg)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=0)
    full = dict(to_hf_tensors(model.to(dtype).state_dict(), cfg))
    del model
    src_spec = trainer_shard_spec(cfg, src_layout)
    dst_spec = engine_shard_spec(cfg, dst_layout, rank_offset=offset)
    plan = plan_reshard(src_spec, dst_spec, Topology.single_node(world))
    src = local_tensors(full, rank_sharding(cfg, src_layout, rank)) if rank < src_layout.world_size else {}
    mine = next((r for r in dst_spec.ranks if r.rank == rank), None)
    dst = {n: torch.full(s, float("nan"), dtype=dtype) for n, s in mine.buffers} if mine else {}
    pieces = mine.pieces if mine else ()
    del full  # from here on each process holds only its shards, as a real trainer and engine do

    run_plan(plan, rank, src, dst, dtype, bucket_bytes=bucket_bytes, verify=True)
    exact = _check(cfg, pieces, dst)
    for t in dst.values():  # the baseline is checked on its own writes
        t.fill_(float("nan"))
    _baseline(src_spec.shapes(), src_spec, pieces, rank, src, dst, dtype, bucket_bytes)
    exact &= _check(cfg, pieces, dst)
    flag = torch.tensor(int(exact))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    times = _timed({
        "seconds": lambda: run_plan(plan, rank, src, dst, dtype, bucket_bytes=bucket_bytes, verify=True),
        "seconds_no_checksum": lambda: run_plan(plan, rank, src, dst, dtype, bucket_bytes=bucket_bytes, verify=False),
        "floor_seconds": lambda: _raw_exchange(plan, rank, dtype),
        "baseline_seconds": lambda: _baseline(src_spec.shapes(), src_spec, pieces, rank, src, dst, dtype,
                                              bucket_bytes),
    }, repeats)
    return times | {"exact": bool(flag), "plan": plan}


def _check(cfg: ModelConfig, pieces, dst) -> bool:
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=0)
    full = dict(to_hf_tensors(model.to(torch_dtype(cfg)).state_dict(), cfg))
    return all(torch.equal(dst[p.buffer][p.buffer_slices()], full[p.param][p.box.slices()]) for p in pieces)


def run_real(cfg: ModelConfig, src_layout: Layout, dst_layout: InferenceLayout, offset: int,
             bucket_bytes: int = 32 << 20, repeats: int = 3) -> dict:
    from rlhf.parallel.launch import run_ranks

    world = max(src_layout.world_size, offset + dst_layout.world_size)
    res = run_ranks(worker, world, cfg, src_layout, dst_layout, offset, world, bucket_bytes, repeats,
                    timeout_s=3600, collective_timeout_s=600)
    plan = res[0]["plan"]
    r0 = res[0]
    return {"bytes_minimal": plan.bytes_minimal, "bytes_network": plan.bytes_network,
            "bytes_local": plan.bytes_local, "seconds": round(r0["seconds"], 4),
            "seconds_no_checksum": round(r0["seconds_no_checksum"], 4),
            "floor_seconds": round(r0["floor_seconds"], 4), "baseline_seconds": round(r0["baseline_seconds"], 4),
            "exact": r0["exact"], "processes": world,
            "gb_per_s": round(plan.bytes_network / r0["seconds"] / 1e9, 3),
            "seconds_over_floor": round(r0["seconds"] / r0["floor_seconds"], 2) if r0["floor_seconds"] else None,
            "speedup_vs_baseline": round(r0["baseline_seconds"] / r0["seconds"], 2)}
