"""A step's rollouts as multi-turn episodes (`agent.environment` set): G episodes per prompt, run turn by turn
on the engines (`rlhf.agents.runner`), each group's turns on one engine (its prompt and turns stay in that
engine's prefix cache), rewarded by their environments.

The rule for episodes an environment broke (timeout, env_error) or whose tokens cannot be trusted
(token_mismatch): counted (`agent/episodes_*`), their loss mask all zeros (nothing of theirs is trained), and
their reward replaced by the mean of their group's trained episodes, so the group's baseline is that of the
episodes that count.
"""

from __future__ import annotations

import itertools
import time
from contextlib import nullcontext

import torch

from actors.vllm.engine import Completion
from rlhf.agents.environment import load_environment
from rlhf.agents.episode import Episode, Limits, Status
from rlhf.agents.runner import run_episodes
from rlhf.schema import RunConfig

# Each call's episodes hold their environments under keys of their own (`run_episodes`' key_base): StaleSync's
# producer and an evaluation run episodes on the same environment workers at once.
_CALLS = itertools.count()
KEYS_PER_CALL = 1 << 32


def episodes_of(cfg: RunConfig, roles, generate, tok, rows, prompts, seed: int = 0):
    """Run the episodes of `rows`: with the run's environments, or the agent function against the chat endpoint."""
    if cfg.agent.function is not None:
        from rlhf.agents.endpoint import ChatFormat, load_function, run_agent_function

        fmt = ChatFormat(dict(cfg.agent.chat_roles) or ChatFormat().roles, cfg.agent.chat_assistant_prefix)
        return run_agent_function(load_function(cfg.agent.function), generate, tok, rows, limits_of(cfg), fmt, seed)
    return run_episodes(generate, environments(cfg, roles), rows, prompts, tok, limits_of(cfg), seed=seed,
                        key_base=next(_CALLS) * KEYS_PER_CALL)


def limits_of(cfg: RunConfig) -> Limits:
    g = cfg.agent
    return Limits(max_turns=g.max_turns, max_tokens=g.max_tokens, turn_tokens=g.turn_tokens,
                  step_timeout_s=g.step_timeout_s)


def environments(cfg: RunConfig, roles):
    """The run's environment workers (`Roles.environment_pool`), or environments in this process where the roles
    have none (built by hand, as tests do)."""
    make_env = load_environment(cfg.agent.environment, cfg.agent.environment_args)
    if not getattr(roles, "environments", None):
        return make_env
    return roles.environment_pool(tuple(make_env().stop))


def collect_episodes(cfg: RunConfig, roles, sampler, tok, step: int, turn=nullcontext, route_stages=None) -> dict:
    """The step's `rlhf.driver.rollout.Rollout`, as its fields. `route_stages` (routing replay): each turn's
    routes kept in blocks per trainer stage (`actors.roles.Roles.generate`); an episode keeps its last turn's."""
    P, G = cfg.data.prompts_per_step, cfg.algorithm.group_size
    rows = sampler.next(P)
    prompts = [tok.encode(r.prompt).ids[: cfg.data.max_prompt_tokens] for r in rows]
    seed = cfg.seed * 100_003 + step * 101

    def generate(contexts, max_tokens, stop, seeds, episodes):
        return roles.generate(contexts, n=1, seed=seed, seeds=seeds, engine_of=[e // G for e in episodes],
                              max_tokens=max_tokens, stop=list(stop), route_stages=route_stages)

    with turn():
        t0 = time.time()
        eps, counts = episodes_of(cfg, roles, generate, tok, [r for r in rows for _ in range(G)],
                                  [p for p in prompts for _ in range(G)], seed=seed)
        seconds = time.time() - t0
    rewards_PG = torch.tensor([e.reward for e in eps], dtype=torch.float32).view(P, G)
    trained_PG = torch.tensor([e.trained for e in eps]).view(P, G)
    scores_PG = rewards_PG.clone()
    fill = torch.where(trained_PG, rewards_PG, 0).sum(1) / trained_PG.sum(1).clamp(min=1)
    rewards_PG = torch.where(trained_PG, rewards_PG, fill[:, None])
    sampled = sum(sum(e.mask) for e in eps)
    return dict(rows=rows, prompt_ids=prompts, completions=[completion(e, e.index // G) for e in eps],
                rewards_PG=rewards_PG, scores_PG=scores_PG, groups_drawn=P, generate_seconds=seconds,
                reward_seconds=0.0, generated_tokens=sampled, agent=agent_metrics(eps, counts))


def completion(e: Episode, prompt_index: int) -> Completion:
    """The episode as the batch takes a sample: everything after the prompt, with its loss mask (all zeros where
    it is not trained), behaviour logprobs, per-token weight versions (observations: -1) and its last turn's
    routes (None: no turn was sampled; the trainer routes such a sample itself)."""
    sampled = [v for v, m in zip(e.versions, e.mask) if m]
    mask = tuple(e.mask) if e.trained else (0,) * len(e.mask)
    return Completion(prompt_index, tuple(e.ids), tuple(e.logp), e.status.value, min(sampled, default=-1),
                      token_versions=tuple(e.versions), loss_mask=mask, routes=e.routes)


def agent_metrics(eps: list[Episode], counts) -> dict[str, float]:
    n = max(len(eps), 1)
    m = {f"agent/episodes_{s.value}": counts.get(s.value, 0) / n for s in Status if s is not Status.running}
    sampled = sum(sum(e.mask) for e in eps)
    observed = sum(len(e.mask) - sum(e.mask) for e in eps)
    called = [e for e in eps if e.trained and len(e.mask) > sum(e.mask)]  # the environment answered a turn
    later = [(c, x) for e in eps for c, x in zip(e.contexts[1:], e.cached[1:])]  # turns after the first
    hit = sum(x for _, x in later) / max(sum(c for c, _ in later), 1)
    return m | {"agent/prefix_cache_hit_rate": hit, "agent/turns_mean": sum(e.turns for e in eps) / n,
                "agent/token_mismatch": counts["token_mismatch"], "agent/restarted": counts["restarted"],
                "agent/env_steps": counts["env_steps"], "agent/sampled_tokens": sampled,
                "agent/observation_tokens": observed,
                "agent/success": sum(e.reward > 0 for e in eps if e.trained) / n,
                "agent/tool_call_rate": len(called) / n,
                "agent/success_given_call": sum(e.reward > 0 for e in called) / max(len(called), 1)}


# agent/* metrics that count (summed over batches); the others are shares and means (averaged)
SUMMED = ("agent/token_mismatch", "agent/restarted", "agent/env_steps", "agent/sampled_tokens",
          "agent/observation_tokens")


def merge_agent_metrics(batches: list[dict]) -> dict[str, float]:
    """The agent/* metrics of a step that trains on the episodes of several batches (StaleSync: a batch's
    metrics ride with its first group): counts summed, shares and means averaged over the batches."""
    if len(batches) <= 1:
        return dict(batches[0]) if batches else {}
    keys = {k for m in batches for k in m}
    return {k: sum(m.get(k, 0) for m in batches) / (1 if k in SUMMED else len(batches)) for k in sorted(keys)}


def run_greedy_episodes(cfg: RunConfig, roles, tok, rows, prompts) -> float:
    """Held-out success: one greedy episode per row, the share whose environment rewarded them (> 0)."""

    def generate(contexts, max_tokens, stop, seeds, episodes):
        return roles.generate(contexts, n=1, seed=0, seeds=seeds, engine_of=list(episodes), max_tokens=max_tokens,
                              stop=list(stop), temperature=0.0, phase="evaluate")

    eps, _ = episodes_of(cfg, roles, generate, tok, rows, prompts)
    return sum(e.reward > 0 for e in eps) / max(len(eps), 1)
