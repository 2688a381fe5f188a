"""Reward workers: rule verifiers that score decoded responses against reference answers.

A plain class (a Ray actor where the driver spawns it). `exact_match` is the tiny task's check (the
response's leading integer equals the answer); `math_verify` compares final answers symbolically with
Hugging Face's math-verify (LaTeX, fractions, sets, ...), the verifier DAPO / Open-R1 style math runs
use. A response that cannot be parsed scores 0, never an exception that would stop the run.
"""

from __future__ import annotations

import time
from typing import Sequence

from rlhf.config.schema import RewardKind


def exact_match(response: str, answer: str) -> float:
    from rlhf.data.arithmetic import is_correct

    return float(is_correct(response, answer))


def math_verify_score(response: str, answer: str) -> float:
    from math_verify import parse, verify

    try:
        gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
        return float(bool(verify(gold, parse(response))))
    except Exception:  # math-verify raises on some malformed LaTeX: an unparseable answer is wrong
        return 0.0


RULES = {RewardKind.exact_match: exact_match, RewardKind.math_verify: math_verify_score}


class RuleRewardWorker:
    def __init__(self, kind: RewardKind):
        if kind not in RULES:
            raise ValueError(f"reward.kind = {kind.value!r} is not a rule verifier; use one of "
                             f"{[k.value for k in RULES]}")
        self.kind, self.rule = kind, RULES[kind]

    def score(self, responses: Sequence[str], answers: Sequence[str]) -> dict:
        t0 = time.time()
        scores = [self.rule(r, a) for r, a in zip(responses, answers, strict=True)]
        return {"scores": scores, "start": t0, "seconds": time.time() - t0}
