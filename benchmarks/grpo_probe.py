"""A single-process GRPO probe on the tiny task: does RL move held-out accuracy, and how fast?

    .venv/bin/python benchmarks/grpo_probe.py [--steps 120] [--lr 5e-4] [--prompts 32] [--group 8]

Not the product loop (that is `rlhf train`, with placement, Ray actors and resharding): one torch
policy, one vLLM engine updated exactly after every step, GRPO advantages, PPO-clip loss (on-policy, one
update per batch). Prints held-out greedy accuracy (vLLM) every `--eval-every` steps and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="out/tiny")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=10)
    args = ap.parse_args()

    import torch

    from actors.vllm_engine import VLLMEngine
    from rlhf.algorithms.advantages import grpo_advantages
    from rlhf.algorithms.losses import ppo_clip_loss
    from rlhf.config.schema import LossAggregation, RolloutConfig
    from rlhf.data.arithmetic import is_correct
    from rlhf.data.prompts import load_prompts
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.model.hf_io import load_pretrained, to_hf_tensors
    from rlhf.parallel.trainer import token_logprobs

    torch.manual_seed(0)
    tok = load_tokenizer(args.policy)
    train = load_prompts([f"{args.policy}/train.jsonl"]).rows
    heldout = load_prompts([f"{args.policy}/heldout.jsonl"]).rows
    policy = load_pretrained(args.policy)
    cfg = policy.config
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    engine = VLLMEngine(args.policy, RolloutConfig(max_new_tokens=6, temperature=1.0), max_model_len=64)
    held_ids = [tok.encode(r.prompt).ids for r in heldout]

    def accuracy() -> float:
        outs = engine.generate(held_ids, n=1, temperature=0.0, max_tokens=6)
        return sum(is_correct(tok.decode(c.token_ids, skip_special_tokens=True), r.answer)
                   for c, r in zip(outs, heldout)) / len(heldout)

    rng = random.Random(0)
    start, t0, history = accuracy(), time.time(), []
    print(f"step 0 held-out accuracy {start:.3f}", flush=True)
    for step in range(1, args.steps + 1):
        rows = rng.sample(train, args.prompts)
        prompts = [tok.encode(r.prompt).ids for r in rows]
        samples = engine.generate(prompts, n=args.group, seed=step)
        rewards = torch.tensor([float(is_correct(tok.decode(s.token_ids, skip_special_tokens=True),
                                                 rows[s.prompt_index].answer)) for s in samples])
        adv = grpo_advantages(rewards.view(args.prompts, args.group)).reshape(-1)
        seqs = [prompts[s.prompt_index] + list(s.token_ids) for s in samples]
        T = max(map(len, seqs))
        ids = torch.full((len(seqs), T), cfg.pad_token_id)
        attn = torch.zeros_like(ids)
        mask = torch.zeros(len(seqs), T - 1)
        for i, (s, c) in enumerate(zip(seqs, samples)):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            mask[i, len(prompts[c.prompt_index]) - 1:len(s) - 1] = 1  # positions predicting response tokens
        logp, _ = token_logprobs(policy(ids, attn), ids)
        out = ppo_clip_loss(logp, logp.detach(), adv, mask, 0.2, 0.28, LossAggregation.token_mean)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        engine.update_weights(list(to_hf_tensors(policy.state_dict(), cfg)), version=step)
        if step % args.eval_every == 0:
            acc = accuracy()
            history.append((step, acc))
            print(f"step {step} reward {rewards.mean():.3f} held-out accuracy {acc:.3f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    print(json.dumps({"steps": args.steps, "heldout_accuracy_start": start, "heldout_accuracy_end": history[-1][1],
                      "seconds": round(time.time() - t0, 1), "history": history}))


if __name__ == "__main__":
    main()
