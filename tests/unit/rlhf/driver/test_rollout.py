"""One step's rollouts: DAPO dynamic sampling keeps only groups whose rewards differ and draws more
prompts until the batch is full; the overlong penalty lowers the reward of long responses. The engine
group is an in-process stand-in whose completions are fixed per prompt; scoring is the real rule
verifier (the engine itself is covered by tests/e2e)."""

import dataclasses

import torch

from actors.reward import RuleRewardWorker
from actors.vllm_engine import Completion
from rlhf.schema import AlgorithmConfig, DataConfig, RewardKind, RolloutConfig, RunConfig
from rlhf.data.prompts import PromptRow
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenizer import build_tokenizer
from rlhf.driver.rollout import collect

TOK = build_tokenizer(32)


class StandInRoles:
    """Prompts whose answer ends in 0 are always solved, in 1 never, otherwise every other sample."""

    def __init__(self):
        self.reward = RuleRewardWorker(RewardKind.exact_match)
        self.generated = 0

    def generate(self, prompts, n, seed, **kw):
        out = []
        for i, p in enumerate(prompts):
            a, b = TOK.decode(p).rstrip("=").split("+")
            answer = str(int(a) + int(b))
            for j in range(n):
                right = answer.endswith("0") or (not answer.endswith("1") and j % 2 == 0)
                text = answer if right else answer + "9"
                ids = tuple(TOK.encode(text).ids) + (2,)
                out.append(Completion(i, ids, tuple([-0.1] * len(ids)), "stop", 0))
        self.generated += len(prompts)
        return out

    def score(self, responses, answers, prompts=None):
        return self.reward.score(responses, answers, prompts).scores, []


def _rows():
    return [PromptRow(f"{a}+{b}=", str(a + b), f"x:{a}") for a in range(10, 30) for b in (0, 1, 3)]


def _cfg(**algo):
    return RunConfig(data=DataConfig(prompts_per_step=6), algorithm=AlgorithmConfig(group_size=4, **algo),
                     rollout=RolloutConfig(max_new_tokens=4))


def test_dynamic_sampling_keeps_groups_with_signal_and_refills():
    roles = StandInRoles()
    ro = collect(_cfg(dynamic_sampling=True), roles, PromptSampler(_rows(), 6, seed=0), TOK, step=1)
    assert len(ro.rows) == 6 and len(ro.completions) == 24
    spread = ro.rewards_PG.max(1).values - ro.rewards_PG.min(1).values
    assert (spread > 0).all()  # every kept group carries signal
    assert ro.groups_drawn > 6 and roles.generated == ro.groups_drawn  # more prompts were drawn to refill
    for row, comps in zip(ro.rows, [ro.completions[i * 4:(i + 1) * 4] for i in range(6)]):
        assert all(TOK.decode(list(c.token_ids), skip_special_tokens=True).startswith(row.answer) for c in comps[::2])


def test_oversampled_draws_fill_the_batch_in_fewer_calls():
    """data.gen_prompts_per_step (verl's gen_batch_size): a draw generates more prompts than the batch
    needs, so one call usually fills it; the batch is still prompts_per_step groups with signal."""
    roles = StandInRoles()
    calls = []
    generate = roles.generate
    roles.generate = lambda prompts, **kw: calls.append(len(prompts)) or generate(prompts, **kw)
    cfg = dataclasses.replace(_cfg(dynamic_sampling=True), data=DataConfig(prompts_per_step=6, gen_prompts_per_step=12))
    ro = collect(cfg, roles, PromptSampler(_rows(), 6, seed=0), TOK, step=1)
    assert len(ro.rows) == 6 and (ro.rewards_PG.max(1).values > ro.rewards_PG.min(1).values).all()
    assert calls[0] == 12 and ro.groups_drawn == sum(calls)
    plain, plain_calls = StandInRoles(), []
    plain_generate = plain.generate
    plain.generate = lambda prompts, **kw: plain_calls.append(len(prompts)) or plain_generate(prompts, **kw)
    collect(_cfg(dynamic_sampling=True), plain, PromptSampler(_rows(), 6, seed=0), TOK, step=1)
    assert len(calls) == 1 < len(plain_calls)  # the same prompts without oversampling needed a refill


def test_without_dynamic_sampling_the_first_draw_is_the_batch():
    roles = StandInRoles()
    ro = collect(_cfg(), roles, PromptSampler(_rows(), 6, seed=0), TOK, step=1)
    assert ro.groups_drawn == 6 and len(ro.completions) == 24
    assert torch.equal(ro.rewards_PG, ro.scores_PG)


def test_overlong_penalty_lowers_long_responses():
    roles = StandInRoles()
    cfg = _cfg(overlong_buffer_tokens=2, overlong_penalty=1.0)
    cfg = dataclasses.replace(cfg, rollout=RolloutConfig(max_new_tokens=3))
    ro = collect(cfg, roles, PromptSampler(_rows(), 6, seed=0), TOK, step=1)
    lengths = torch.tensor([len(c.token_ids) for c in ro.completions], dtype=torch.float32).view(6, 4)
    expect = -((lengths - 1) / 2).clamp(0, 1)  # 0 up to max - buffer = 1 token, -1 at max = 3 tokens
    assert torch.allclose(ro.rewards_PG - ro.scores_PG, expect)
