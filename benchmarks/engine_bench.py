"""vLLM engine on CPU: weight-update seconds against bytes, and generation tokens/s.

    .venv/bin/python benchmarks/engine_bench.py [--models qwen3_moe_tiny,qwen3_moe_small]

For each model: start an engine on random weights (std 0.02), time `update_weights` (the exact,
checked shared-memory path) three times with new weights, and time sampled generation of 16 prompts
x 8 samples x 32 new tokens. One JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3_moe_tiny,qwen3_moe_small")
    args = ap.parse_args()
    from actors.vllm.engine import VLLMEngine
    from rlhf.config import load_model_config
    from rlhf.schema import RolloutConfig
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained, to_hf_tensors
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    for name in args.models.split(","):
        cfg = load_model_config(f"configs/model/{name}.yaml", ["max_position_embeddings=256"])
        with tempfile.TemporaryDirectory() as d:
            m = Qwen3MoeForCausalLM(cfg)
            m.init_weights(0)
            save_tokenizer(build_tokenizer(cfg.vocab_size), d)
            save_pretrained(m, d)
            t0 = time.perf_counter()
            engine = VLLMEngine(d, RolloutConfig(max_new_tokens=32), max_model_len=256)
            start_s = time.perf_counter() - t0
            updates = []
            for v in range(1, 4):
                m.init_weights(v)
                info = engine.update_weights(list(to_hf_tensors(m.state_dict(), cfg)), version=v)
                updates.append(info["seconds"])
            prompts = [[1] + [5 + (i + j) % 10 for j in range(8)] for i in range(16)]
            engine.generate(prompts, n=8, seed=0)  # warm-up
            t0 = time.perf_counter()
            out = engine.generate(prompts, n=8, seed=1)
            gen_s = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for c in out)
            print(json.dumps({"model": name, "params": sum(p.numel() for p in m.parameters()),
                              "update_bytes": info["bytes"], "update_seconds_best": round(min(updates), 3),
                              "update_gb_per_s": round(info["bytes"] / min(updates) / 1e9, 3),
                              "engine_start_s": round(start_s, 1), "gen_tokens": tokens,
                              "gen_tokens_per_s": round(tokens / gen_s, 1)}), flush=True)
            del engine


if __name__ == "__main__":
    main()
