"""One step's rollouts: DAPO dynamic sampling keeps only groups whose rewards differ and draws more
prompts until the batch is full; the overlong penalty lowers the reward of long responses; streamed draws
keep the groups a whole draw keeps, whatever order the groups finish in, and stop the others once the batch
is full. The engine group is an in-process stand-in whose completions are fixed per prompt (streamed in a
shuffled order); scoring is the real rule verifier (the engines themselves are covered by tests/e2e)."""

import dataclasses
import random

import pytest

import torch

from actors.reward import RuleRewardWorker
from actors.vllm.engine import Completion
from rlhf.schema import AlgorithmConfig, DataConfig, RewardKind, RolloutConfig, RunConfig
from rlhf.data.prompts import PromptRow
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenizer import build_tokenizer
from rlhf.driver.rollout import collect
from rlhf.errors import ShortBatch

TOK = build_tokenizer(32)


class StandInRoles:
    """Prompts whose answer ends in 0 are always solved, in 1 never, otherwise every other sample."""

    def __init__(self, order_seed: int = 0):
        self.reward = RuleRewardWorker(RewardKind.exact_match)
        self.generated = self.never_came = 0
        self.order_seed = order_seed

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

    def submit_score(self, responses, answers, prompts):
        return self.reward.score(responses, answers, prompts)

    def wait_score(self, sent):
        return [sent]

    def score_ready(self, sent):
        return True

    def stream(self, prompts, n, seed, phase="generate"):
        return StandInStream(self, self.generate(prompts, n, seed), n, self.order_seed)


class StandInStream:
    """A draw's groups in a shuffled order, a few at a time; `stop` records how many never came."""

    def __init__(self, roles, comps, n, order_seed):
        groups = [(i, comps[i * n:(i + 1) * n]) for i in range(len(comps) // n)]
        rng = random.Random(order_seed)
        rng.shuffle(groups)
        self.roles, self.left, self.rng = roles, groups, rng

    @property
    def done(self):
        return not self.left

    def arrived(self):
        k = self.rng.randint(1, 3)
        out, self.left = self.left[:k], self.left[k:]
        return out

    def stop(self):
        self.roles.never_came += len(self.left)
        self.left = []


def _rows():
    return [PromptRow(f"{a}+{b}=", str(a + b), f"x:{a}") for a in range(10, 30) for b in (0, 1, 3)]


def _cfg(stream: bool = False, **algo):
    return RunConfig(data=DataConfig(prompts_per_step=6), algorithm=AlgorithmConfig(group_size=4, **algo),
                     rollout=RolloutConfig(max_new_tokens=4, stream_groups=stream))


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


@pytest.mark.parametrize("order_seed", range(8))
@pytest.mark.parametrize("gen_prompts", [6, 12, 20])
def test_streamed_draws_keep_what_whole_draws_keep_in_any_finishing_order(order_seed, gen_prompts):
    """Groups scored as they finish, in a random order, a few at a time: the batch (rows, samples, rewards) and
    the prompts drawn are those of whole draws; the groups not back when the batch filled are stopped."""
    def run(stream):
        roles = StandInRoles(order_seed)
        cfg = dataclasses.replace(_cfg(stream, dynamic_sampling=True),
                                  data=DataConfig(prompts_per_step=6, gen_prompts_per_step=gen_prompts))
        sampler = PromptSampler(_rows(), 6, seed=0)
        return collect(cfg, roles, sampler, TOK, step=1), roles, sampler.state_dict()

    (whole, _, cursor), (streamed, roles, streamed_cursor) = run(False), run(True)
    assert streamed.rows == whole.rows and streamed.completions == whole.completions
    assert torch.equal(streamed.rewards_PG, whole.rewards_PG) and torch.equal(streamed.scores_PG, whole.scores_PG)
    assert streamed.groups_drawn == whole.groups_drawn and streamed_cursor == cursor
    assert whole.groups_stopped == 0 and streamed.groups_stopped == roles.never_came
    if roles.never_came:  # a stopped group's tokens are not counted
        assert streamed.generated_tokens < whole.generated_tokens
    else:
        assert streamed.generated_tokens == whole.generated_tokens


def test_a_streamed_draw_with_room_for_every_group_stops_none():
    roles = StandInRoles(3)
    ro = collect(_cfg(True), roles, PromptSampler(_rows(), 6, seed=0), TOK, step=1)  # no filter: 6 of 6 needed
    assert ro.groups_drawn == 6 and ro.groups_stopped == 0 and roles.never_came == 0


def test_a_streamed_draw_stops_the_groups_it_no_longer_needs():
    roles = StandInRoles(5)
    cfg = dataclasses.replace(_cfg(True, dynamic_sampling=True),
                              data=DataConfig(prompts_per_step=6, gen_prompts_per_step=20))
    ro = collect(cfg, roles, PromptSampler(_rows(), 6, seed=0), TOK, step=1)
    assert len(ro.rows) == 6 and ro.groups_drawn == 20 and ro.groups_stopped == roles.never_came == 4


def _hard_rows():
    """Mostly prompts no sample gets right or every sample does (answers ending in 1 or 0): few carry signal."""
    return [PromptRow(f"{a}+{b}=", str(a + b), f"x:{a}") for a in range(10, 40) for b in (0, 1) if (a + b) % 10 in (0, 1)] \
        + [PromptRow("12+3=", "15", "x:s")]


@pytest.mark.parametrize("stream", [False, True])
def test_out_of_draws_the_step_trains_on_fewer_groups_or_stops_as_configured(stream):
    """algorithm.max_draws (verl's max_num_gen_batches) bounds the draws; short of the batch the step trains on
    the groups kept, or with fail_short_batch stops with what to change (verl's behaviour)."""
    roles = StandInRoles(1)
    ro = collect(_cfg(stream, dynamic_sampling=True, max_draws=2), roles, PromptSampler(_hard_rows(), 6, seed=0), TOK,
                 step=3)
    assert roles.generated == ro.groups_drawn and 0 < len(ro.rows) < 6
    assert (ro.rewards_PG.max(1).values > ro.rewards_PG.min(1).values).all()
    more = collect(_cfg(stream, dynamic_sampling=True, max_draws=8), StandInRoles(1),
                   PromptSampler(_hard_rows(), 6, seed=0), TOK, step=3)
    assert more.groups_drawn > ro.groups_drawn and len(more.rows) > len(ro.rows)
    with pytest.raises(ShortBatch, match="step 3: dynamic sampling kept .* of data.prompts_per_step=6 .*max_draws=2"):
        collect(_cfg(stream, dynamic_sampling=True, max_draws=2, fail_short_batch=True), StandInRoles(1),
                PromptSampler(_hard_rows(), 6, seed=0), TOK, step=3)


def test_rlhf_train_reports_a_short_batch_as_one_line(monkeypatch, capsys):
    """`rlhf train` stopped by fail_short_batch prints what to change (no traceback) and exits 1."""
    import rlhf.driver
    from rlhf.cli import main

    def short(cfg, log):
        raise ShortBatch("step 1: dynamic sampling kept 2 of data.prompts_per_step=6 groups; raise algorithm.max_draws")

    monkeypatch.setattr(rlhf.driver, "train", short)
    from pathlib import Path

    config = Path(__file__).resolve().parents[4] / "configs" / "tiny_cpu.yaml"
    assert main(["train", str(config), "algorithm.fail_short_batch=true"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rlhf train: step 1: dynamic sampling kept") and "Traceback" not in err


class CodeRoles(StandInRoles):
    """The stand-in's answers written as programs (`print(N)`, a wrong one `print(N9)`), scored by the real code
    verifier against each row's stdin/stdout test."""

    def __init__(self, order_seed: int = 0):
        from rlhf.schema import SandboxConfig

        super().__init__(order_seed)
        self.reward = RuleRewardWorker(RewardKind.code, SandboxConfig(timeout_s=5.0, processes=2))

    def generate(self, prompts, n, seed, **kw):
        out = super().generate(prompts, n, seed, **kw)
        return [dataclasses.replace(c, token_ids=tuple(CODE_TOK.encode(
            f"print({TOK.decode(list(c.token_ids), skip_special_tokens=True)})").ids) + (2,)) for c in out]


CODE_TOK = build_tokenizer(32, __import__("rlhf.tiny", fromlist=["CODE_ALPHABET"]).CODE_ALPHABET)


@pytest.mark.parametrize("stream", [False, True])
def test_code_verdicts_count_every_sample_scored_in_every_draw(stream):
    import json

    rows = [dataclasses.replace(r, answer=json.dumps({"inputs": [""], "outputs": [r.answer]})) for r in _rows()]
    roles = CodeRoles()
    ro = collect(_cfg(stream, dynamic_sampling=True), roles, PromptSampler(rows, 6, seed=0), CODE_TOK, step=1)
    assert len(ro.rows) == 6 and (ro.rewards_PG.max(1).values > ro.rewards_PG.min(1).values).all()
    scored = ro.groups_drawn - roles.never_came  # a streamed draw stops the groups it no longer needs
    assert sum(ro.verdicts.values()) == scored * 4 and set(ro.verdicts) == {"passed", "failed"}
