"""A single-process GRPO probe on the tiny task: does RL move held-out accuracy, and how fast?

    .venv/bin/python benchmarks/grpo_probe.py [--policy out/tiny] [--steps 150] [--seed 0] [--lr ...] ...

Not the product loop (that is `rlhf train`, with placement, Ray actors and resharding): one torch
policy, one vLLM engine updated exactly after every step, GRPO advantages, PPO-clip loss. Each step
samples `--prompts` x `--group` completions, optionally keeps only groups whose rewards differ
(`--dynamic`, DAPO dynamic sampling, refilling from further prompts), takes `old_logp` from the
policy before the step's updates, and makes `--minibatches` optimizer steps over a shuffled split
of the batch. The defaults are the best recipe found (see docs/tiny_world.md, "Does RL move it?").
Prints held-out greedy accuracy (vLLM) every `--eval-every` steps and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="out/tiny")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed: prompt order, engine sampling, torch")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.99)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (after dynamic sampling)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per batch (old_logp from before)")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the batch")
    ap.add_argument("--clip-low", type=float, default=0.2)
    ap.add_argument("--clip-high", type=float, default=0.28)
    ap.add_argument("--no-std", action="store_true", help="Dr. GRPO: do not divide advantages by the group std")
    ap.add_argument("--agg", default="token_mean", choices=["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
    ap.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True,
                    help="keep only groups with reward variance; refill (--no-dynamic: keep all)")
    ap.add_argument("--max-rounds", type=int, default=3, help="generation rounds per step with --dynamic")
    ap.add_argument("--entropy", type=float, default=0.0, help="entropy bonus coefficient")
    ap.add_argument("--kl", type=float, default=0.0, help="k3 KL to the starting policy, coefficient")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--eval-every", type=int, default=10)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()

    import torch

    from actors.vllm.engine import VLLMEngine
    from rlhf.algorithms.advantages import grpo_advantages, nonzero_variance_groups
    from rlhf.algorithms.losses import aggregate, kl_penalty, ppo_clip_loss
    from rlhf.schema import KLEstimator, LossAggregation, RolloutConfig
    from rlhf.data.arithmetic import is_correct
    from rlhf.data.prompts import load_prompts
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.model.hf_io import load_pretrained, to_hf_tensors
    from rlhf.parallel.trainer import token_logprobs

    torch.manual_seed(args.seed)
    agg = LossAggregation[args.agg]
    tok = load_tokenizer(args.policy)
    train = load_prompts([f"{args.policy}/train.jsonl"]).rows
    heldout = load_prompts([f"{args.policy}/heldout.jsonl"]).rows
    policy = load_pretrained(args.policy)
    ref = load_pretrained(args.policy).eval() if args.kl > 0 else None
    cfg = policy.config
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(args.beta1, args.beta2), weight_decay=0.0)
    engine = VLLMEngine(args.policy, RolloutConfig(max_new_tokens=args.max_tokens, temperature=args.temperature),
                        max_model_len=64)
    held_ids = [tok.encode(r.prompt).ids for r in heldout]

    def accuracy() -> float:
        outs = engine.generate(held_ids, n=1, temperature=0.0, max_tokens=args.max_tokens)
        return sum(is_correct(tok.decode(c.token_ids, skip_special_tokens=True), r.answer)
                   for c, r in zip(outs, heldout)) / len(heldout)

    def logprobs(model, ids, attn):
        logits = model(ids, attn)
        if args.temperature != 1.0:
            logits = logits / args.temperature  # the distribution the engine sampled from
        return token_logprobs(logits, ids)

    P, G = args.prompts, args.group
    rng = random.Random(args.seed)
    start, t0, history = accuracy(), time.time(), []
    print(f"step 0 held-out accuracy {start:.3f}", flush=True)
    for step in range(1, args.steps + 1):
        rows, prompts, samples, rewards, kept_groups, n_gen = [], [], [], [], 0, 0
        for rnd in range(args.max_rounds if args.dynamic else 1):
            need = P - kept_groups
            batch_rows = rng.sample(train, need if not args.dynamic else max(need, P // 2))
            batch_prompts = [tok.encode(r.prompt).ids for r in batch_rows]
            outs = engine.generate(batch_prompts, n=G, seed=args.seed * 1_000_003 + step * 17 + rnd)
            n_gen += len(batch_rows)
            r = torch.tensor([float(is_correct(tok.decode(s.token_ids, skip_special_tokens=True),
                                               batch_rows[s.prompt_index].answer)) for s in outs]).view(-1, G)
            keep = nonzero_variance_groups(r) if args.dynamic else torch.ones(len(batch_rows), dtype=torch.bool)
            by_prompt = [outs[i * G:(i + 1) * G] for i in range(len(batch_rows))]
            for i in torch.nonzero(keep).flatten().tolist():
                if kept_groups == P:
                    break
                rows.append(batch_rows[i])
                prompts.append(batch_prompts[i])
                samples.extend(by_prompt[i])
                rewards.append(r[i])
                kept_groups += 1
            if kept_groups == P:
                break
        if kept_groups == 0:
            print(f"step {step}: no group with signal", flush=True)
            continue
        rewards_PG = torch.stack(rewards)
        adv = grpo_advantages(rewards_PG, normalize_std=not args.no_std).reshape(-1)
        # samples are grouped in order: sample j belongs to kept prompt j // G
        seqs = [prompts[j // G] + list(s.token_ids) for j, s in enumerate(samples)]
        T = max(map(len, seqs))
        ids = torch.full((len(seqs), T), cfg.pad_token_id)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(seqs), T - 1)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            mask[i, len(prompts[i // G]) - 1:len(s) - 1] = 1  # positions predicting response tokens
        with torch.no_grad():
            old_logp, _ = logprobs(policy, ids, attn)
            ref_logp = logprobs(ref, ids, attn)[0] if ref is not None else None
        B, M = len(seqs), args.minibatches
        for _ in range(args.epochs):
            perm = torch.randperm(B) if M > 1 else torch.arange(B)
            for mb in perm.chunk(M):
                logp, ent = logprobs(policy, ids[mb], attn[mb])
                out = ppo_clip_loss(logp, old_logp[mb], adv[mb], mask[mb], args.clip_low, args.clip_high, agg)
                loss = out.loss
                if args.entropy:
                    loss = loss - args.entropy * aggregate(ent, mask[mb], agg)
                if ref_logp is not None:
                    loss = loss + args.kl * aggregate(kl_penalty(logp, ref_logp[mb], KLEstimator.k3), mask[mb], agg)
                opt.zero_grad()
                loss.backward()
                if args.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                opt.step()
        engine.update_weights(list(to_hf_tensors(policy.state_dict(), cfg)), version=step)
        if step % args.eval_every == 0:
            acc = accuracy()
            history.append((step, acc))
            print(f"step {step} reward {rewards_PG.mean():.3f} groups {kept_groups}/{n_gen} "
                  f"held-out accuracy {acc:.3f} ({time.time() - t0:.0f} s)", flush=True)
    last3 = [a for _, a in history[-3:]]
    print(json.dumps({"steps": args.steps, "heldout_accuracy_start": start, "heldout_accuracy_end": history[-1][1],
                      "heldout_accuracy_last3_mean": round(sum(last3) / len(last3), 4),
                      "seconds": round(time.time() - t0, 1), "history": history, "flags": vars(args)}))


if __name__ == "__main__":
    main()
