"""Gloo point-to-point against shared memory for the same plan, in the same processes, side by side.

    .venv/bin/python benchmarks/shm_bench.py --model configs/model/qwen3_moe_small.yaml \
        --src tp=2 --dst tp=2 --dst-rank-offset 2 --pairs 0:2,1:3 --repeats 7

One process per transfer rank. Per repeat, each variant runs one sync (every rank starts together, the
time is the slowest rank's), in turn, after a warm-up of each:
- `gloo`: `run_plan` with no same-device pair (every non-local transfer over gloo);
- `shm`: the `--pairs` declared same-device (their transfers through /dev/shm, the rest over gloo);
- `shm_all`: every pair of different ranks declared (on CPU any two processes of a node can share memory);
- `shm_fresh`: as `shm`, but dropping the kept segments before each sync (what reuse across syncs saves).
Prints one JSON line: per variant the median and min seconds, GB/s over the plan's network bytes, the
bytes that went through shared memory, and whether every engine buffer equals the reference bit for bit.
Checksums stay on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from rlhf.config import load_model_config
from rlhf.schema import ModelConfig
from rlhf.model.hf_io import to_hf_tensors, torch_dtype
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from weight_sync.pieces import local_tensors
from weight_sync import shm
from benchmarks.reshard_bench import parse_layout
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.p2p import run_plan
from weight_sync.plan import Topology, plan_reshard


def _full(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=0)
    return dict(to_hf_tensors(model.to(torch_dtype(cfg)).state_dict(), cfg))


def worker(rank: int, cfg: ModelConfig, src_layout: Layout, dst_layout: InferenceLayout, offset: int, world: int,
           pairs: list[tuple[int, int]], bucket_bytes: int, repeats: int) -> dict:
    dtype = torch_dtype(cfg)
    full = _full(cfg)
    dst_spec = engine_shard_spec(cfg, dst_layout, rank_offset=offset)
    plan = plan_reshard(trainer_shard_spec(cfg, src_layout), dst_spec, Topology.single_node(world))
    src = local_tensors(full, rank_sharding(cfg, src_layout, rank)) if rank < src_layout.world_size else {}
    mine = next((r for r in dst_spec.ranks if r.rank == rank), None)
    dst = {n: torch.full(s, float("nan"), dtype=dtype) for n, s in mine.buffers} if mine else {}
    pieces = mine.pieces if mine else ()
    reference = {p.param: full[p.param][p.box.slices()].clone() for p in pieces}
    del full
    all_pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    variants = {"gloo": (None, False), "shm": (pairs, False), "shm_all": (all_pairs, False), "shm_fresh": (pairs, True)}

    def sync(name: str):
        same_device, fresh = variants[name]
        if fresh:
            shm.release_segments()
        dist.barrier()
        t0 = time.perf_counter()
        stats = run_plan(plan, rank, src, dst, dtype, bucket_bytes=bucket_bytes, same_device=same_device)
        elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed), stats

    seconds: dict[str, list[float]] = {name: [] for name in variants}
    out = {}
    for name in variants:
        sync(name)  # warm-up (and, for the reusing variants, the segments' first touch)
    for _ in range(repeats):
        for name in variants:
            seconds[name].append(sync(name)[0])
    for name in variants:  # one more, into NaN-filled buffers, to check
        for t in dst.values():
            t.fill_(float("nan"))
        _, stats = sync(name)
        exact = torch.tensor(int(all(torch.equal(dst[p.buffer][p.buffer_slices()], reference[p.param])
                                     for p in pieces)))
        dist.all_reduce(exact, op=dist.ReduceOp.MIN)
        shm_bytes = torch.tensor(stats.bytes_shm)
        dist.all_reduce(shm_bytes)
        out[name] = {"median_s": round(statistics.median(seconds[name]), 4), "min_s": round(min(seconds[name]), 4),
                     "gb_per_s": round(plan.bytes_network / statistics.median(seconds[name]) / 1e9, 3),
                     "bytes_shm": int(shm_bytes), "exact": bool(exact)}
    return {"variants": out, "bytes_network": plan.bytes_network, "bytes_local": plan.bytes_local,
            "bytes_minimal": plan.bytes_minimal}


def main(argv=None) -> int:
    from rlhf.parallel.launch import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--src", default="tp=2")
    ap.add_argument("--dst", default="tp=2")
    ap.add_argument("--dst-rank-offset", type=int, default=2)
    ap.add_argument("--pairs", default="0:2,1:3", help="same-device pairs, a:b,c:d")
    ap.add_argument("--bucket-mb", type=float, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    cfg = load_model_config(a.model)
    src_layout, dst_layout = parse_layout(Layout, a.src), parse_layout(InferenceLayout, a.dst)
    pairs = [tuple(int(x) for x in p.split(":")) for p in a.pairs.split(",") if p]
    world = max(src_layout.world_size, a.dst_rank_offset + dst_layout.world_size)
    res = run_ranks(worker, world, cfg, src_layout, dst_layout, a.dst_rank_offset, world, pairs,
                    int(a.bucket_mb * (1 << 20)), a.repeats, timeout_s=3600, collective_timeout_s=600)[0]
    print(json.dumps({"model": cfg.name, "src": str(src_layout), "dst": a.dst, "dst_rank_offset": a.dst_rank_offset,
                      "pairs": pairs, "processes": world, "bucket_mb": a.bucket_mb, "repeats": a.repeats, **res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
