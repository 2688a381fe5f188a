"""Routing replay on the small shape: how often a bf16 engine and the fp32 trainer pick other experts, how far
apart their logprobs are with and without replaying the engine's routes, what the routes weigh and cost.

    .venv/bin/python -m benchmarks.routing_replay [--prompts 16 --n 4 --tokens 32 --rounds 3]
    .venv/bin/python -m benchmarks.routing_replay --policy out/tiny --prompts 32 --n 16 --tokens 6 --rounds 1

The small MoE (configs/model/qwen3_moe_small.yaml: 140 M parameters, 32 experts top-4) on random weights
(our own code), a vLLM engine in bf16 capturing its routes, the trainer's model in fp32 in this process.
Each round: generate (capture off, then on), then one trainer forward + backward over the batch without
and with the engine's routes forced (the first forward also compares the live choice, as the trainer's
does). The extra step time of replay is (capture-on generation + replayed training) over (capture-off
generation + plain training) - 1, median over rounds. Parity: |trainer - engine| logprob over response
tokens. Also `affected_mean_off` / `affected_mean_replay`: the same over the response tokens after a
mismatched route in their sample (where replay can change anything). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per sample (EOS ignored, but with --policy)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="the engine's dtype (the trainer is fp32)")
    ap.add_argument("--model", default="configs/model/qwen3_moe_small.yaml")
    ap.add_argument("--policy", default=None,
                    help="a policy directory instead (e.g. out/tiny from `rlhf make-tiny`): its weights, and its "
                         "train.jsonl prompts in order; samples stop at EOS")
    args = ap.parse_args(argv)

    import torch

    from actors.vllm.engine import VLLMEngine
    from rlhf.batch import TokenBatch
    from rlhf.config import load_model_config
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
    from rlhf.parallel.trainer import token_logprobs
    from rlhf.parity import logprob_parity
    from rlhf.moe.routing import RouteStats, Routing
    from rlhf.schema import DType, RolloutConfig

    if args.policy:
        from rlhf.data.tokenizer import load_tokenizer
        from rlhf.model.hf_io import load_pretrained

        model = load_pretrained(args.policy)
        cfg, tok = model.config, load_tokenizer(args.policy)
        with open(os.path.join(args.policy, "train.jsonl")) as f:
            prompts = [tok.encode(json.loads(line)["prompt"]).ids for line, _ in zip(f, range(args.prompts))]
    else:
        cfg = load_model_config(args.model, ["max_position_embeddings=256"])
        model = Qwen3MoeForCausalLM(cfg)
        model.init_weights(args.seed)
        g = torch.Generator().manual_seed(args.seed)
        lengths = torch.randint(16, 49, (args.prompts,), generator=g).tolist()
        prompts = [[1] + torch.randint(3, cfg.vocab_size, (n - 1,), generator=g).tolist() for n in lengths]
    max_len = min(256, cfg.max_position_embeddings)

    def forward(batch, routing=None):
        return token_logprobs(model(batch.input_ids_BT, batch.attention_mask_BT, routing=routing),
                              batch.input_ids_BT)[0]

    def train_step(batch, routing=None):
        model.zero_grad(set_to_none=True)
        logp = forward(batch, routing)
        m = batch.mask_BT
        (-(logp * m).sum() / m.sum()).backward()

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        d = args.policy or tmp
        if not args.policy:
            save_tokenizer(build_tokenizer(cfg.vocab_size), d)
            save_pretrained(model, d)
        engine = VLLMEngine(d, RolloutConfig(dtype=DType(args.dtype), max_new_tokens=args.tokens),
                            max_model_len=max_len, capture_routes=True)
        try:
            def generate(capture: bool, seed: int):
                engine.llm.collective_rpc("rlhf_set_route_capture", args=(capture,))
                engine.capture_routes = capture
                return engine.generate(prompts, n=args.n, seed=seed, ignore_eos=not args.policy)

            def as_batch(outs):
                return TokenBatch.from_samples([prompts[c.prompt_index] for c in outs], [c.token_ids for c in outs],
                                               [c.logp for c in outs], routes=[c.routes for c in outs])

            warm = as_batch(generate(True, 10_000))  # warm-up: both generation modes, both training modes
            generate(False, 10_000)
            train_step(warm)
            train_step(warm, Routing(warm.routes_BTLk, warm.routes_BTLk))
            for r in range(args.rounds):  # alternate which mode runs first, so drift in load does not favour one
                first, second = (False, True) if r % 2 == 0 else (True, False)
                timed = {capture: _timed(lambda: generate(capture, r)) for capture in (first, second)}
                (plain, gen_off), (outs, gen_on) = timed[False], timed[True]  # one seed: the same samples
                batch = as_batch(outs)
                replayed = lambda: train_step(batch, Routing(batch.routes_BTLk, batch.routes_BTLk))  # noqa: E731
                t = {mode: _timed(replayed if mode else lambda: train_step(batch))[1] for mode in (first, second)}
                train_off, train_on = t[False], t[True]
                rounds.append({"gen_off": gen_off, "gen_on": gen_on, "train_off": train_off, "train_on": train_on,
                               "same_samples": [c.token_ids for c in plain] == [c.token_ids for c in outs]})
        finally:
            engine.close()

    B, T = batch.input_ids_BT.shape
    with torch.no_grad():
        live = Routing(engine_BTLk=batch.routes_BTLk)
        lp_off = forward(batch, live)
        lp_on = forward(batch, Routing(forced_BTLk=batch.routes_BTLk))
    stats = RouteStats.of(live.differ_count_BT(B, T), batch.routes_BTLk)
    per_layer = [round(float(live.differs[i].sum()) / max(int((batch.routes_BTLk[:, :, i, 0] >= 0).sum()), 1), 5)
                 for i in sorted(live.differs)]
    mask = batch.mask_BT.bool()
    affected = mask & ((live.differ_count_BT(B, T)[:, :-1] > 0).cumsum(1) > 0)
    gap = lambda lp: float((lp - batch.rollout_logp_BT).abs()[affected].mean()) if affected.any() else 0.0  # noqa: E731
    off = logprob_parity(lp_off, batch.rollout_logp_BT, batch.mask_BT)
    on = logprob_parity(lp_on, batch.rollout_logp_BT, batch.mask_BT)
    share = lambda on_s, off_s: statistics.median(a / b - 1 for a, b in zip(on_s, off_s))  # noqa: E731
    step_on = [x["gen_on"] + x["train_on"] for x in rounds]
    step_off = [x["gen_off"] + x["train_off"] for x in rounds]
    result = {
        "model": args.policy or cfg.name, "engine_dtype": args.dtype, "samples": B, "new_tokens": args.tokens,
        "route_mismatch_off": round(stats.mismatch, 5), "tokens_any_mismatch_off": round(stats.tokens_any_mismatch, 5),
        "route_mismatch_per_layer": per_layer,
        "parity_mean_off": off.mean_abs_diff, "parity_p99_off": off.p99_abs_diff, "parity_max_off": off.max_abs_diff,
        "parity_mean_replay": on.mean_abs_diff, "parity_p99_replay": on.p99_abs_diff, "parity_max_replay": on.max_abs_diff,
        "mean_reduction": round(off.mean_abs_diff / max(on.mean_abs_diff, 1e-12), 3),
        "p99_reduction": round(off.p99_abs_diff / max(on.p99_abs_diff, 1e-12), 3),
        "max_reduction": round(off.max_abs_diff / max(on.max_abs_diff, 1e-12), 3),
        "affected_tokens": int(affected.sum()), "affected_mean_off": gap(lp_off), "affected_mean_replay": gap(lp_on),
        "route_bytes_per_step": sum(c.routes.nbytes for c in outs),
        "route_bytes_trainer": batch.routes_BTLk.numel() * batch.routes_BTLk.element_size(),
        "replay_overhead_share": round(share(step_on, step_off), 4),
        "replay_overhead_share_per_round": [round(a / b - 1, 4) for a, b in zip(step_on, step_off)],
        "capture_overhead_share": round(share([x["gen_on"] for x in rounds], [x["gen_off"] for x in rounds]), 4),
        "train_replay_overhead_share": round(share([x["train_on"] for x in rounds], [x["train_off"] for x in rounds]), 4),
        "rounds": [{k: round(v, 3) if isinstance(v, float) else v for k, v in x.items()} for x in rounds],
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
