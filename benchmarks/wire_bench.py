"""The wire alone, bf16 against fp8_block, side by side: the small model's sync from a trainer of dp2 x ep2 (two
gloo processes) to one tp1 engine rank (a third process receiving into staging buffers, no vLLM), `run_plan`
with its checksums, the receiver's float check on.

    .venv/bin/python -m benchmarks.wire_bench [--rounds 3]

bf16: the trainer's fp32 shards cast while packed (what a bf16 sync does); fp8_block: each sender's buffers
quantized as their first transfer reads them (`weight_sync.quant.OwnerWire`, what a quantized sync does).
Per round and variant, each rank's seconds; prints one JSON line last: per variant the slowest rank's seconds
per round and the plan's bytes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from rlhf.config import load_model_config
from rlhf.host_memory import AnonymousBuffers
from rlhf.parallel.launch import free_port, run_ranks
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.sharding.sync import SyncLayout
from rlhf.sharding.trainer import rank_sharding
from weight_sync.group import transfer_group
from weight_sync.p2p import run_plan
from weight_sync.plan import Topology
from weight_sync.quant import owner_wire_buffers, quantized_buffers, sent_buffers

SMALL = "configs/model/qwen3_moe_small.yaml"


def _sync(quantization: str) -> SyncLayout:
    return SyncLayout(load_model_config(SMALL), Layout(dp=2, ep=2), InferenceLayout(tp=1), Topology.single_node(3),
                      engine_dtype="bfloat16", quantization=quantization)


def worker(rank: int, port: int, quantization: str, rounds: int) -> list[float]:
    torch.set_num_threads(1)
    sync = _sync(quantization)
    group = transfer_group("gloo", "127.0.0.1", port, rank, 3, 120)
    plan, dtype = sync.plan(), getattr(torch, sync.dst_spec().dtype)
    fmt, out = sync.wire_format(), []
    if rank < 2:
        own = rank_sharding(sync.model, sync.trainer, rank)
        shards = {n: torch.randn(s, generator=torch.Generator().manual_seed(rank)) * 0.02
                  for n, s in own.buffer_shapes().items()}
        typed = sync.typed_specs()[0]
        quantized = quantized_buffers(next(r for r in typed.ranks if r.rank == rank), fmt, typed.shapes()) if fmt else None
        for _ in range(rounds):
            dist.barrier()
            t0 = time.perf_counter()
            src = shards if fmt is None else owner_wire_buffers(
                {n: t for n, t in shards.items() if n in sent_buffers(plan, rank)}, quantized, fmt)
            run_plan(plan, rank, src, None, dtype, group=group)
            out.append(time.perf_counter() - t0)
        return out
    mine = next(r for r in sync.dst_spec().ranks if r.rank == 2)
    staging = AnonymousBuffers(dict(mine.buffers), dtype)
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        run_plan(plan, 2, None, staging, dtype, group=group, check_finite=True)
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    result = {"model": SMALL, "trainer": "dp2 x ep2", "engine": "tp1", "rounds": args.rounds}
    for quantization in ("none", "fp8_block"):
        per_rank = run_ranks(worker, 3, free_port(), quantization, args.rounds, timeout_s=600)
        slowest = [round(max(r[i] for r in per_rank), 3) for i in range(args.rounds)]
        print(f"{quantization}: slowest rank per round {slowest} s", flush=True)
        result[quantization] = {"seconds": slowest, "bytes": _sync(quantization).plan().bytes_minimal}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
