"""The engine-side install of a weight sync on CPU, side by side: vLLM's layer-wise reload as it comes
(`plain`), the same reload with its element counts remembered (`remembered`, `actors.vllm.worker_ext.
_counts_remembered`), and the direct install from the staging buffers (`direct`, `actors.vllm.install`),
which the loop uses where the model's layers allow it.

    python -m benchmarks.install_bench                                    # the tiny model, 8 rounds
    python -m benchmarks.install_bench --model configs/model/qwen3_moe_small.yaml --rounds 3

One engine (tp1, its engine core in this process), random weights of the model's shape (our code, under
`out/bench/<model name>`). Each round installs a second set of random weights with each variant in turn,
so all three see the same machine: the reloads from whole HF tensors, the direct install from the
buffers a sync stages (vLLM's names and shapes). After the rounds, the engine's logprobs on a few sequences
after each variant's install are compared: `exact` says all three serve bit for bit the same model. Prints
one JSON line: seconds of each variant per round, their medians and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "remembered", "direct")


def _plain(worker, hf: list) -> float:
    """In the worker: vLLM's reload without the remembered counts; seconds."""
    import time

    t0 = time.perf_counter()
    worker._rlhf_reload_layerwise(iter(hf))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.install_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO / "configs" / "model" / "qwen3_moe_tiny.yaml"))
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")

    import torch
    from safetensors.torch import save_file

    from actors.vllm.engine import VLLMEngine
    from benchmarks.reshard_loop import write_policy
    from rlhf.config import load_model_config
    from rlhf.sharding.layout import InferenceLayout
    from rlhf.sharding.engine import engine_shard_spec
    from rlhf.model.hf_io import to_hf_tensors
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
    from rlhf.schema import RolloutConfig
    from weight_sync.pieces import fill_buffers

    cfg = load_model_config(args.model)
    model_dir = write_policy(cfg, REPO / "out" / "bench")
    update = Qwen3MoeForCausalLM(cfg)
    update.init_weights(1, std=0.02)  # the weights every install puts in (another seed than the engine's)
    hf = sorted(to_hf_tensors(update.state_dict(), cfg))
    del update
    whole = dict(hf)
    mine = engine_shard_spec(cfg, InferenceLayout(tp=1)).ranks[0]
    staged = {n: torch.zeros(s) for n, s in mine.buffers}  # as a sync stages them: padding rows zero
    fill_buffers(mine.pieces, mine.buffer_shapes(), lambda p: whole[p.param][p.box.slices()], staged)
    seqs = torch.randint(3, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0)).tolist()

    files = REPO / "out" / "bench" / f"{cfg.name}_install"  # what each install reads (the worker loads the file)
    files.mkdir(parents=True, exist_ok=True)
    save_file(dict(hf), files / "hf.safetensors")
    save_file(staged, files / "staged.safetensors")
    engine = VLLMEngine(str(model_dir), RolloutConfig(engine_core_in_process=True),
                        max_model_len=min(cfg.max_position_embeddings, 256))

    def rpc(variant: str) -> float:
        if variant == "plain":
            return engine.llm.collective_rpc(_plain, args=(hf,))[0]
        how, name = ("reload", "hf") if variant == "remembered" else ("direct", "staged")
        return engine.llm.collective_rpc("rlhf_install_file", args=(str(files / f"{name}.safetensors"), how))[0]

    try:
        for variant in VARIANTS:  # warm-up: the direct install built, the counts remembered
            rpc(variant)
        seconds = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:
                seconds[variant].append(round(rpc(variant), 4))
        logprobs = {}
        for variant in VARIANTS:
            rpc(variant)
            logprobs[variant] = engine.sequence_logprobs(seqs)
    finally:
        engine.close()
    medians = {v: statistics.median(s) for v, s in seconds.items()}
    print(json.dumps({"model": cfg.name, "tensors_hf": len(hf), "buffers_staged": len(staged), "rounds": args.rounds,
                      "seconds": seconds, **{f"{v}_median_s": m for v, m in medians.items()},
                      "remembered_over_plain": round(medians["plain"] / medians["remembered"], 2),
                      "direct_over_remembered": round(medians["remembered"] / medians["direct"], 2),
                      "exact": all(logprobs[v] == logprobs["plain"] for v in VARIANTS)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
