"""One step's rollouts: draw prompts, generate a group of samples per prompt on the engines, score
them, and (DAPO) keep only groups whose rewards differ, drawing more prompts until the batch is full.

Legend: P prompts (groups), G samples per prompt.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from rlhf.algorithms.advantages import nonzero_variance_groups, overlong_penalty
from rlhf.data.verifiers import RULES
from rlhf.schema import RewardKind, RunConfig

MAX_DRAWS = 4  # dynamic sampling: at most this many draws per step


@dataclass(frozen=True)
class Rollout:
    rows: list  # P PromptRows
    prompt_ids: list[list[int]]  # P
    completions: list  # P * G, grouped by prompt (actors.vllm_engine.Completion)
    rewards_PG: torch.Tensor  # what the advantages see (rule score + overlong penalty)
    scores_PG: torch.Tensor  # the verifier's score alone (accuracy)
    groups_drawn: int
    generate_seconds: float
    reward_seconds: float
    generated_tokens: int


def collect(cfg: RunConfig, roles, sampler, tok, step: int, route_stages=None) -> Rollout:
    """`route_stages` (routing replay): each completion's routes stay in the object store, in blocks per
    trainer stage of these MoE layers (`actors.roles.Roles.generate`)."""
    P, G = cfg.data.prompts_per_step, cfg.algorithm.group_size
    over = max(cfg.data.gen_prompts_per_step, P) / P  # draws generate this many prompts per group still missing
    kept: list[tuple] = []  # (row, prompt ids, completions, rewards, scores) per group
    drawn, gen_s, rew_s, tokens = 0, 0.0, 0.0, 0
    for draw in range(MAX_DRAWS if cfg.algorithm.dynamic_sampling else 1):
        rows = sampler.next(math.ceil((P - len(kept)) * over) if cfg.algorithm.dynamic_sampling else P)
        prompts = [tok.encode(r.prompt).ids[: cfg.data.max_prompt_tokens] for r in rows]
        t0 = time.time()
        comps = roles.generate(prompts, n=G, seed=cfg.seed * 100_003 + step * 101 + draw, route_stages=route_stages)
        gen_s += time.time() - t0
        tokens += sum(len(c.token_ids) for c in comps)
        texts = [tok.decode(list(c.token_ids), skip_special_tokens=True) for c in comps]
        t0 = time.time()
        scores, _ = roles.score(texts, [rows[c.prompt_index].answer for c in comps],
                                [rows[c.prompt_index].prompt for c in comps])
        rew_s += time.time() - t0
        scores_PG = torch.tensor(scores).view(len(rows), G)
        lengths = torch.tensor([len(c.token_ids) for c in comps])
        penalty = overlong_penalty(lengths, cfg.rollout.max_new_tokens, cfg.algorithm.overlong_buffer_tokens,
                                   cfg.algorithm.overlong_penalty).view(len(rows), G)
        rewards_PG = scores_PG + penalty
        drawn += len(rows)
        keep = (nonzero_variance_groups(rewards_PG) if cfg.algorithm.dynamic_sampling
                else torch.ones(len(rows), dtype=torch.bool))
        for i in range(len(rows)):
            if keep[i]:
                kept.append((rows[i], prompts[i], comps[i * G:(i + 1) * G], rewards_PG[i], scores_PG[i]))
        last = (rows, prompts, comps, rewards_PG, scores_PG)
        if len(kept) >= P:
            break
    if not kept:  # no group carried signal in any draw: train on the last draw (its advantages are 0)
        rows, prompts, comps, rewards_PG, scores_PG = last
        kept = [(rows[i], prompts[i], comps[i * G:(i + 1) * G], rewards_PG[i], scores_PG[i]) for i in range(len(rows))]
    kept = kept[:P]
    return Rollout([k[0] for k in kept], [k[1] for k in kept], [c for k in kept for c in k[2]],
                   torch.stack([k[3] for k in kept]), torch.stack([k[4] for k in kept]), drawn, gen_s, rew_s, tokens)


def heldout_accuracy(cfg: RunConfig, roles, tok, rows) -> float:
    """Greedy accuracy of the engines' current weights on the held-out prompts, by the run's rule
    verifier (exact match when the run's reward is a model: accuracy needs the reference answers)."""
    rule = RULES.get(cfg.reward.kind, RULES[RewardKind.exact_match])
    prompts = [tok.encode(r.prompt).ids[: cfg.data.max_prompt_tokens] for r in rows]
    comps = roles.generate(prompts, n=1, seed=0, temperature=0.0, phase="evaluate")
    texts = [tok.decode(list(c.token_ids), skip_special_tokens=True) for c in comps]
    return sum(rule(t, rows[c.prompt_index].answer) for t, c in zip(texts, comps)) / len(comps)
