"""One vLLM engine decoding in this process, without Ray: seconds for a batch, and with --profile its ops.

    python -m benchmarks.decode_probe                        # small model, bf16, core 0, 4 prompts x 8 x 128
    python -m benchmarks.decode_probe --core 1 &  python -m benchmarks.decode_probe --core 0   # two side by side
    VLLM_CPU_OMP_THREADS_BIND=0-1 python -m benchmarks.decode_probe --prompts 8              # one engine, two cores
    python -m benchmarks.decode_probe --profile              # the ops of one generate (torch.profiler), on stderr
    python -m benchmarks.decode_probe rollout.enforce_eager=false   # run config overrides (here: torch.compile)

The policy is `benchmarks/e2e_bench.py`'s (random weights of configs/small_cpu.yaml's model, built once under
`out/small/policy`). Every completion runs to --new-tokens (`ignore_eos`). Two timed generates after start; the last
line is one JSON object: the engine's `start_seconds`, its MoE layers by experts' kernel (`moe_kernels`:
rollout.cpu_moe_kernel), `generate_seconds` of each, the tokens, the decode step's milliseconds and its floor: the
weight bytes a step reads (`decode_bytes`: every weight but the embedding, as `benchmarks/floors.py` counts them) at
one thread's memory bandwidth, probed before the engine starts and after it closes (`memory_gb_per_s`, each the best
of three; the floor takes the higher), and `decode_over_floor`. Without a launcher's OMP_NUM_THREADS the engine's
process may run more threads than its core: run with OMP_NUM_THREADS=1 to stand for a Ray actor of one CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_probe", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "small_cpu.yaml"))
    parser.add_argument("--core", type=int, default=0, help="the core the engine's threads bind to")
    parser.add_argument("--prompts", type=int, default=4, help="prompts, each sampled --samples times")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="a third generate under torch.profiler: ops on stderr")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config (rollout.*)")
    args = parser.parse_args(argv)
    for name in ("prompts", "samples", "new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if not 0 <= args.core < (os.cpu_count() or 1):
        parser.error(f"--core {args.core}: this machine has cores 0-{(os.cpu_count() or 1) - 1}")

    from benchmarks.e2e_bench import build_policy
    from rlhf.config import load_run_config
    from rlhf.errors import ConfigError

    try:
        cfg = load_run_config(args.config, args.overrides)
    except ConfigError as e:
        parser.error(str(e))
    policy = build_policy(cfg)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    from actors.vllm.engine import VLLMEngine
    from rlhf.schema import DeviceType

    from benchmarks.floors import engine_decode_bytes, memory_rate

    gb_per_s = [round(memory_rate(), 2)]  # one thread's, best of three (a floor is what the machine can do)
    rollout = replace(cfg.rollout, engine_core_in_process=True)
    t0 = time.perf_counter()
    engine = VLLMEngine(str(policy), rollout, device_type=DeviceType.cpu, cpu_cores=[args.core],
                        max_model_len=16 + args.new_tokens)
    start_seconds = round(time.perf_counter() - t0, 1)
    try:
        prompts = [[1] + list(range(10 + i, 17 + i)) for i in range(args.prompts)]

        def generate() -> int:
            out = engine.generate(prompts, n=args.samples, max_tokens=args.new_tokens, ignore_eos=True, seed=1)
            return sum(len(c.token_ids) for c in out)

        seconds, tokens = [], 0
        for _ in range(2):
            t0 = time.perf_counter()
            tokens = generate()
            seconds.append(round(time.perf_counter() - t0, 2))
        if args.profile:
            with torch.profiler.profile() as prof:
                generate()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50),
                  file=sys.stderr)
    finally:
        engine.close()
    gb_per_s.append(round(memory_rate(), 2))
    read = engine_decode_bytes(cfg)
    floor_ms = read / (max(gb_per_s) * 1e9) * 1e3
    step_ms = min(seconds) / args.new_tokens * 1e3
    print(json.dumps({"overrides": args.overrides, "start_seconds": start_seconds, "moe_kernels": engine.moe_kernels,
                      "core": args.core,
                      "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                      "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "sequences": args.prompts * args.samples,
                      "tokens": tokens, "generate_seconds": seconds,
                      "decode_step_ms": round(step_ms, 1), "decode_bytes": round(read),
                      "memory_gb_per_s": gb_per_s, "decode_floor_ms": round(floor_ms, 2),
                      "decode_over_floor": round(step_ms / floor_ms, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
