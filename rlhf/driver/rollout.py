"""One step's rollouts: draw prompts, generate a group of samples per prompt on the engines, score
them, and (DAPO) keep only groups whose rewards differ, drawing more prompts until the batch is full.

Legend: P prompts (groups), G samples per prompt.
"""

from __future__ import annotations

import math
from collections import Counter
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from rlhf.algorithms.advantages import nonzero_variance_groups, overlong_penalty
from rlhf.data.verifiers import accuracy_scores
from rlhf.errors import ShortBatch
from rlhf.schema import RunConfig


@dataclass(frozen=True)
class Rollout:
    rows: list  # P PromptRows
    prompt_ids: list[list[int]]  # P
    completions: list  # P * G, grouped by prompt (actors.vllm.engine.Completion)
    rewards_PG: torch.Tensor  # what the advantages see (rule score + overlong penalty)
    scores_PG: torch.Tensor  # the verifier's score alone (accuracy)
    groups_drawn: int
    generate_seconds: float
    reward_seconds: float
    generated_tokens: int  # of the groups that finished (a stopped group's tokens are not counted)
    groups_stopped: int = 0  # streamed rollouts: groups whose generation was stopped, the batch being full
    # StaleSync: each completion's reference logprobs at its response tokens, computed as soon as its batch was
    # made (`TokenBatch.response_rows`); None: the step computes them
    ref_logp: list | None = None
    verdicts: dict = field(default_factory=dict)  # the code verifier: samples scored per status, all draws
    agent: dict = field(default_factory=dict)  # multi-turn episodes: agent/* metrics (`rlhf.driver.episodes`)


def collect(cfg: RunConfig, roles, sampler, tok, step: int, route_stages=None, turn=nullcontext) -> Rollout:
    """`route_stages` (routing replay): each completion's routes stay in the object store, in blocks per
    trainer stage of these MoE layers (`actors.roles.Roles.generate`). `turn()`: a context held while the
    engines generate (co-located StaleSync: the devices' turn, `rlhf.driver.turns`); scoring runs outside it.

    With `rollout.stream_groups` (and no routes to keep) each draw is streamed: every group is scored as soon
    as its engine finishes it, the groups are kept or filtered in prompt order as in a whole draw, and once
    the batch is full the draw's other groups are stopped where they are. The kept groups are those the
    whole draw keeps, so a seed gives the same batch either way."""
    if cfg.agent.enabled:
        from rlhf.driver.episodes import collect_episodes

        return Rollout(**collect_episodes(cfg, roles, sampler, tok, step, turn, route_stages))
    P, G = cfg.data.prompts_per_step, cfg.algorithm.group_size
    over = max(cfg.data.gen_prompts_per_step, P) / P  # draws generate this many prompts per group still missing
    stream = cfg.rollout.stream_groups and route_stages is None
    kept: list[tuple] = []  # (row, prompt ids, completions, rewards, scores) per group
    drawn, gen_s, rew_s, tokens, stopped = 0, 0.0, 0.0, 0, 0
    verdicts: Counter = Counter()
    for draw in range(cfg.algorithm.max_draws if cfg.algorithm.dynamic_sampling else 1):
        rows = sampler.next(math.ceil((P - len(kept)) * over) if cfg.algorithm.dynamic_sampling else P)
        prompts = [tok.encode(r.prompt).ids[: cfg.data.max_prompt_tokens] for r in rows]
        seed = cfg.seed * 100_003 + step * 101 + draw
        d = Draw(cfg, rows, prompts, P - len(kept))
        if stream:  # groups are scored as they finish: all of it in the turn
            with turn():
                gen_s_draw, rew_s_draw = d.streamed(roles, tok, seed)
        else:
            with turn():
                t0 = time.time()
                comps = roles.generate(prompts, n=G, seed=seed, route_stages=route_stages)
            gen_s_draw, t0 = time.time() - t0, time.time()
            d.score(roles, tok, [(i, comps[i * G:(i + 1) * G]) for i in range(len(rows))])
            rew_s_draw = time.time() - t0
        gen_s, rew_s = gen_s + gen_s_draw, rew_s + rew_s_draw
        tokens += d.tokens
        stopped += len(rows) - d.arrived
        drawn += len(rows)
        kept += d.kept
        verdicts.update(d.verdicts)
        if len(kept) >= P:
            break
    if len(kept) < P and cfg.algorithm.fail_short_batch:
        raise ShortBatch(f"step {step}: dynamic sampling kept {len(kept)} of data.prompts_per_step={P} groups (rewards "
                         f"not all equal) in algorithm.max_draws={cfg.algorithm.max_draws} draws of {drawn} prompts; "
                         f"raise algorithm.max_draws or data.gen_prompts_per_step, use easier prompts, or set "
                         f"algorithm.fail_short_batch=false to train on the groups kept")
    if not kept:  # no group carried signal in any draw: train on the last draw (its advantages are 0)
        kept = [d.entry(i) for i in range(len(rows))]
    kept = kept[:P]
    return Rollout([k[0] for k in kept], [k[1] for k in kept], [c for k in kept for c in k[2]],
                   torch.stack([k[3] for k in kept]), torch.stack([k[4] for k in kept]), drawn, gen_s, rew_s, tokens,
                   stopped, verdicts=dict(verdicts))


class Draw:
    """One draw's groups: scored as they come, kept (DAPO: rewards not all equal) in prompt order until
    `need` are kept."""

    def __init__(self, cfg: RunConfig, rows: list, prompts: list, need: int):
        self.cfg, self.rows, self.prompts, self.need = cfg, rows, prompts, need
        self.groups: dict[int, tuple] = {}  # prompt index -> (completions, rewards [G], scores [G])
        self.kept: list[tuple] = []
        self.resolved = 0  # groups 0 .. resolved - 1 are decided
        self.arrived = self.tokens = 0  # groups back from the engines, and their tokens
        self.verdicts: Counter = Counter()  # the code verifier's statuses of every sample scored

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.need

    def entry(self, i: int) -> tuple:
        comps, rewards, scores = self.groups[i]
        return self.rows[i], self.prompts[i], comps, rewards, scores

    def score(self, roles, tok, groups: list[tuple[int, list]], sent=None) -> None:
        """Score `groups` ((prompt index, completions) each), or take the scores of `sent` (`submit`), then
        decide every group now decidable in prompt order."""
        if sent is None:
            sent = self.submit(roles, tok, groups)
        replies = roles.wait_score(sent)
        scores = [x for reply in replies for x in reply.scores]
        for reply in replies:
            self.verdicts.update(reply.verdicts)
        cfg, G = self.cfg, self.cfg.algorithm.group_size
        for g, (i, comps) in enumerate(groups):
            scores_G = torch.tensor(scores[g * G:(g + 1) * G])
            lengths = torch.tensor([len(c.token_ids) for c in comps])
            rewards_G = scores_G + overlong_penalty(lengths, cfg.rollout.max_new_tokens,
                                                    cfg.algorithm.overlong_buffer_tokens, cfg.algorithm.overlong_penalty)
            self.groups[i] = (comps, rewards_G, scores_G)
        while self.resolved in self.groups and not self.full:
            i = self.resolved
            if not cfg.algorithm.dynamic_sampling or bool(nonzero_variance_groups(self.groups[i][1][None])[0]):
                self.kept.append(self.entry(i))
            self.resolved += 1

    def submit(self, roles, tok, groups: list[tuple[int, list]]):
        comps = [c for _, cs in groups for c in cs]
        self.arrived += len(groups)
        self.tokens += sum(len(c.token_ids) for c in comps)
        rows = [self.rows[i] for i, cs in groups for _ in cs]
        texts = [tok.decode(list(c.token_ids), skip_special_tokens=True) for c in comps]
        return roles.submit_score(texts, [r.answer for r in rows], [r.prompt for r in rows])

    def streamed(self, roles, tok, seed: int) -> tuple[float, float]:
        """The draw streamed (`actors.group_stream`): groups scored while others generate, the rest stopped
        once `need` groups are kept. (generation seconds, the scoring's wait after it)."""
        t0 = time.time()
        stream = roles.stream(self.prompts, self.cfg.algorithm.group_size, seed)
        pending: list = []  # (groups, their scoring calls) not yet read
        try:
            while not stream.done and not self.full:
                groups = stream.arrived()
                if groups:
                    pending.append((groups, self.submit(roles, tok, groups)))
                while pending and (stream.done or roles.score_ready(pending[0][1])):
                    self.score(roles, tok, *pending.pop(0))
        finally:
            stream.stop()  # every group not back yet: the batch is full (or an error ends the draw)
        gen_s, t0 = time.time() - t0, time.time()
        for groups, sent in pending:
            if not self.full:
                self.score(roles, tok, groups, sent)
        return gen_s, time.time() - t0


def heldout_accuracy(cfg: RunConfig, roles, tok, rows) -> float:
    """Greedy accuracy of the engines' current weights on the held-out prompts, by the run's rule
    verifier (exact match when the run's reward is a model: accuracy needs the reference answers)."""
    prompts = [tok.encode(r.prompt).ids[: cfg.data.max_prompt_tokens] for r in rows]
    if cfg.agent.enabled:  # an episode's success: its environment's reward, greedy
        from rlhf.driver.episodes import run_greedy_episodes

        return run_greedy_episodes(cfg, roles, tok, rows, prompts)
    comps = roles.generate(prompts, n=1, seed=0, temperature=0.0, phase="evaluate")
    texts = [tok.decode(list(c.token_ids), skip_special_tokens=True) for c in comps]
    return sum(accuracy_scores(cfg.reward, texts, [rows[c.prompt_index].answer for c in comps])) / len(comps)
