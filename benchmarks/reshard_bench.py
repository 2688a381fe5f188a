"""Resharding benchmark: plan a trainer -> engines weight sync and print one JSON line of its numbers.

    python -m benchmarks.reshard_bench --simulate --topology cm384 \\
        --model configs/model/pangu_ultra_moe_718b.yaml \\
        --src pp=12,dp=4,tp=8,ep=4,experts_over_tp_ep=1 --dst tp=4,ep=8,engines=12

`--src` is a training `Layout`, `--dst` an `InferenceLayout`, both as key=value lists. Engine ranks are
numbered from `--dst-rank-offset` (default 0: engines co-located with the first trainer ranks, which
makes their shared tensors local copies). `--simulate` plans only and reports the floor (the busiest
rank's network bytes over its link) as the simulated time, and as `baseline_seconds` the least any
gather-then-broadcast sync takes there: every engine rank receiving the whole model over its link.
Without it the plan runs over real gloo processes on this machine (one per rank of the transfer
world), timed beside its measured floor and the gather-then-broadcast baseline (`benchmarks.reshard_run`):

    python -m benchmarks.reshard_bench --model configs/model/qwen3_moe_small.yaml --src pp=2,tp=2 --dst tp=1,ep=4,engines=1

`--in-loop` measures the same pair through real roles as `rlhf train` runs them (Ray actors, vLLM
engines whose every worker is a rank of the sync group), beside gather-then-broadcast into the same
engines (`benchmarks.reshard_loop`):

    python -m benchmarks.reshard_bench --in-loop --model configs/model/qwen3_moe_small.yaml --src dp=2,ep=2 --dst tp=2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from rlhf.config import load_model_config
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.plan import Topology, plan_reshard
from rlhf.sharding.trainer import trainer_shard_spec


def parse_layout(cls, text: str):
    """`Layout` or `InferenceLayout` from "k=v,k=v"; integers, and 0/1/true/false for booleans."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise ValueError(f"{item!r} in {text!r}: expected key=value with key one of {', '.join(fields)}")
        if isinstance(fields[key].default, bool):
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{key}={value!r}: expected 0, 1, true or false")
            kwargs[key] = value.lower() in ("1", "true")
        else:
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ValueError(f"{key}={value!r}: expected an integer") from None
    return cls(**kwargs)


def parse_topology(text: str) -> Topology:
    if text == "cm384":
        return Topology.cm384()
    name, _, n = text.partition(":")
    if name == "single_node" and n.isdigit():
        return Topology.single_node(int(n))
    raise ValueError(f"topology {text!r}: use cm384 or single_node:N")


def run(args: argparse.Namespace) -> dict:
    cfg = load_model_config(args.model)
    src_layout, dst_layout = parse_layout(Layout, args.src), parse_layout(InferenceLayout, args.dst)
    if args.in_loop:
        from benchmarks.reshard_loop import run_in_loop

        out = {"src": f"trainer {src_layout}", "dst": f"engines {dst_layout}", "model": cfg.name}
        return out | run_in_loop(cfg, src_layout, dst_layout, args.repeats)
    if not args.simulate:
        from benchmarks.reshard_run import run_real

        out = {"src": f"trainer {src_layout}", "dst": f"engines {dst_layout}", "model": cfg.name,
               "dst_rank_offset": args.dst_rank_offset}
        return out | run_real(cfg, src_layout, dst_layout, args.dst_rank_offset, args.bucket_mb << 20, args.repeats)
    topology = parse_topology(args.topology)
    t0 = time.perf_counter()
    src = trainer_shard_spec(cfg, src_layout)
    dst = engine_shard_spec(cfg, dst_layout, rank_offset=args.dst_rank_offset)
    t1 = time.perf_counter()
    plan = plan_reshard(src, dst, topology)
    t2 = time.perf_counter()
    out = plan.summary(topology)
    # gather-then-broadcast at its best: every engine rank receives every tensor whole once over its link
    model_bytes = sum(math.prod(shape) for shape in dst.shapes().values()) * plan.dtype_bytes
    baseline = model_bytes / topology.link_bytes_per_s
    out |= {"model": cfg.name, "topology": topology.name, "dst_rank_offset": args.dst_rank_offset,
            "simulated_seconds": out["floor_seconds"], "baseline_seconds": baseline,
            "speedup_vs_baseline": round(baseline / out["floor_seconds"], 2) if out["floor_seconds"] else None,
            "plan_seconds": round(t2 - t1, 3), "spec_seconds": round(t1 - t0, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reshard_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--simulate", action="store_true", help="plan only and report the floor at the topology's bandwidth")
    parser.add_argument("--in-loop", action="store_true",
                        help="through real roles on Ray (vLLM engines, every worker a sync rank), beside "
                             "gather-then-broadcast into the same engines")
    parser.add_argument("--bucket-mb", type=int, default=32, help="bucket size of the real run (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of the real run (best is kept)")
    parser.add_argument("--topology", default="cm384", help="cm384 or single_node:N")
    parser.add_argument("--model", required=True, help="model YAML, e.g. configs/model/pangu_ultra_moe_718b.yaml")
    parser.add_argument("--src", required=True, help="trainer layout, e.g. pp=12,dp=4,tp=8,ep=4,experts_over_tp_ep=1")
    parser.add_argument("--dst", required=True, help="engine layout, e.g. tp=4,ep=8,engines=12")
    parser.add_argument("--dst-rank-offset", type=int, default=0,
                        help="first engine rank in the transfer world (0: co-located with the trainer's first ranks)")
    args = parser.parse_args(argv)
    try:
        out = run(args)
    except ValueError as e:
        parser.error(str(e))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
