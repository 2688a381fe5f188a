"""How long a vLLM engine takes to start on CPU, and what freezing its import-time heap saves.

    .venv/bin/python -m benchmarks.engine_start_bench [--tp 1,2] [--rounds 2]

Each start is a fresh process that hosts nothing but the engine, as an engine's Ray actor does
(`VLLMEngine(..., own_process=True)`): it imports vLLM, starts an engine of the tiny Qwen3-MoE policy (random
weights, written once by this script) with `--tp` workers, and closes it. Measured per start: wall seconds
until the engine serves, the wall seconds of its `close()`, and the CPU seconds of the process and its children
(vLLM's worker processes at TP > 1) until it exits. Every round runs one start with the heap frozen
(`actors.vllm.platform.freeze_heap`, the default) and one without (`RLHF_FREEZE_HEAP=0`), interleaved. The last
line is one JSON object: per TP degree, each side's median wall, close and CPU seconds and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _child(model_dir: str, tp: int) -> None:
    t0 = time.perf_counter()
    from actors.vllm.engine import VLLMEngine
    from rlhf.schema import RolloutConfig

    engine = VLLMEngine(model_dir, RolloutConfig(tp=tp, cpu_kv_cache_gib=0.25), max_model_len=64, own_process=True)
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    engine.close()
    close = time.perf_counter() - t1
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    print(json.dumps({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "close_s": round(close, 2)}))


def _write_model(d: str) -> None:
    from rlhf.config import load_model_config
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    cfg = load_model_config(str(REPO / "configs/model/qwen3_moe_tiny.yaml"))
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(0)
    save_tokenizer(build_tokenizer(cfg.vocab_size), d)
    save_pretrained(model, d)


def _start(model_dir: str, tp: int, freeze: bool) -> dict:
    env = dict(os.environ, RLHF_FREEZE_HEAP="1" if freeze else "0")
    r = subprocess.run([sys.executable, "-m", "benchmarks.engine_start_bench", "--child", model_dir, "--tp", str(tp)],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"an engine start (tp {tp}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", default="1,2", help="TP degrees, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="starts of each side per TP degree")
    ap.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child, int(args.tp))
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1 start of each side")
    try:
        degrees = [int(t) for t in args.tp.split(",")]
    except ValueError:
        ap.error(f"--tp {args.tp!r}: TP degrees as whole numbers, comma-separated (e.g. 1,2)")
    result = {}
    with tempfile.TemporaryDirectory() as d:
        _write_model(d)
        for tp in degrees:
            runs = {"frozen": [], "unfrozen": []}
            for i in range(args.rounds):
                for side in (("frozen", "unfrozen") if i % 2 == 0 else ("unfrozen", "frozen")):
                    runs[side].append(_start(d, tp, side == "frozen"))
                    print(f"tp {tp} round {i + 1} {side}: {runs[side][-1]}", file=sys.stderr, flush=True)
            med = {side: {k: round(statistics.median(r[k] for r in rs), 2) for k in ("wall_s", "cpu_s", "close_s")}
                   for side, rs in runs.items()}
            result[f"tp{tp}"] = {
                **{f"{k}_{side}": med[side][k] for side in med for k in ("wall_s", "cpu_s", "close_s")},
                "cpu_s_each": {side: [r["cpu_s"] for r in rs] for side, rs in runs.items()},
                "cpu_ratio": round(med["unfrozen"]["cpu_s"] / med["frozen"]["cpu_s"], 3),
                "wall_ratio": round(med["unfrozen"]["wall_s"] / med["frozen"]["wall_s"], 3),
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
