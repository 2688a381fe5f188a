"""Rule verifiers: score a decoded response against a task's reference answer. Pure functions.

`exact_match` is the tiny task's check (the response's leading integer equals the answer); `math_verify`
compares final answers symbolically with Hugging Face's math-verify (LaTeX, fractions, sets, ...), the
verifier DAPO / Open-R1 style math runs use; `code` runs the response's program against the answer's
tests in a sandbox (`rlhf.data.sandbox`). A response that cannot be parsed scores 0, never an exception that
would stop the run. The reward workers (`actors.reward`) and held-out evaluation call `score_batch`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Sequence

from rlhf.data import sandbox
from rlhf.data.arithmetic import is_correct
from rlhf.schema import RewardConfig, RewardKind, SandboxConfig


def exact_match(response: str, answer: str) -> float:
    return float(is_correct(response, answer))


def math_verify_score(response: str, answer: str) -> float:
    from math_verify import parse, verify  # sympy underneath: imported only by runs that verify math

    try:
        gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
        return float(bool(verify(gold, parse(response))))
    except Exception:  # math-verify raises on some malformed LaTeX: an unparseable answer is wrong
        return 0.0


def code_score(response: str, answer: str, cfg: SandboxConfig = SandboxConfig()) -> float:
    return sandbox.check(response, answer, cfg).score


RULES = {RewardKind.exact_match: exact_match, RewardKind.math_verify: math_verify_score, RewardKind.code: code_score}


def score_batch(kind: RewardKind, responses: Sequence[str], answers: Sequence[str],
                cfg: SandboxConfig = SandboxConfig()) -> tuple[list[float], Counter]:
    """One score per response by the rule `kind`, and how many samples had each sandbox status (`code`, which
    runs `cfg.processes` programs at a time; empty for the other rules)."""
    if kind is RewardKind.code:
        results = sandbox.check_batch(responses, answers, cfg)
        return [r.score for r in results], Counter(r.status for r in results)
    rule = RULES[kind]
    return [rule(r, a) for r, a in zip(responses, answers, strict=True)], Counter()


def accuracy_scores(reward: RewardConfig, responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """Scores by the run's rule verifier, for accuracy (held-out evaluation, `rlhf eval`): exact match when the
    run's reward is a model, since accuracy needs the reference answers. A task counts as solved only when every
    test passes, with or without `reward.sandbox.partial_credit`."""
    kind = reward.kind if reward.kind in RULES else RewardKind.exact_match
    return score_batch(kind, responses, answers, replace(reward.sandbox, partial_credit=False))[0]
