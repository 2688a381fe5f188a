"""The engine-side install of a weight sync on CPU, side by side: vLLM's layer-wise reload as it comes,
against the same reload with its element counts remembered (`actors.vllm_worker_ext._counts_remembered`).

    python -m benchmarks.install_bench                                    # the tiny model, 8 rounds
    python -m benchmarks.install_bench --model configs/model/qwen3_moe_small.yaml --rounds 3

One engine (tp1, its engine core in this process), random weights of the model's shape (our code, under
`out/bench/<model name>`), every HF tensor installed per round, the two variants alternating so both
see the same machine. Prints one JSON line: seconds of each variant per round, their medians and ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _time_installs(worker, weights, rounds: int) -> dict:
    """In the worker: alternate the plain and the remembered reload; the first remembered one fills the memo."""
    import time

    worker._rlhf_reload(iter(weights))  # warm-up, and the counts remembered from here on
    out = {"plain": [], "remembered": []}
    for _ in range(rounds):
        for name, reload in (("plain", worker._rlhf_reload_layerwise), ("remembered", worker._rlhf_reload)):
            t0 = time.perf_counter()
            reload(iter(weights))
            out[name].append(round(time.perf_counter() - t0, 4))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.install_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "configs" / "model" / "qwen3_moe_tiny.yaml"))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")

    from safetensors.torch import load_file

    from actors.vllm_engine import VLLMEngine
    from benchmarks.reshard_loop import write_policy
    from rlhf.config import load_model_config
    from rlhf.schema import RolloutConfig

    cfg = load_model_config(args.model)
    model_dir = write_policy(cfg, REPO / "out" / "bench")
    weights = sorted(load_file(str(model_dir / "model.safetensors")).items())
    engine = VLLMEngine(str(model_dir), RolloutConfig(engine_core_in_process=True),
                        max_model_len=min(cfg.max_position_embeddings, 256))
    try:
        seconds = engine.llm.collective_rpc(_time_installs, args=(weights, args.rounds))[0]
    finally:
        engine.close()
    plain, remembered = statistics.median(seconds["plain"]), statistics.median(seconds["remembered"])
    print(json.dumps({"model": cfg.name, "tensors": len(weights), "rounds": args.rounds, "seconds": seconds,
                      "plain_median_s": plain, "remembered_median_s": remembered,
                      "speedup": round(plain / remembered, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
