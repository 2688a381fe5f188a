"""Rule verifiers: score a decoded response against a task's reference answer. Pure functions.

`exact_match` is the tiny task's check (the response's leading integer equals the answer); `math_verify`
compares final answers symbolically with Hugging Face's math-verify (LaTeX, fractions, sets, ...), the
verifier DAPO / Open-R1 style math runs use. A response that cannot be parsed scores 0, never an
exception that would stop the run. The reward workers (`actors.reward`) and held-out evaluation use them.
"""

from __future__ import annotations

from rlhf.data.arithmetic import is_correct
from rlhf.schema import RewardKind


def exact_match(response: str, answer: str) -> float:
    return float(is_correct(response, answer))


def math_verify_score(response: str, answer: str) -> float:
    from math_verify import parse, verify  # sympy underneath: imported only by runs that verify math

    try:
        gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
        return float(bool(verify(gold, parse(response))))
    except Exception:  # math-verify raises on some malformed LaTeX: an unparseable answer is wrong
        return 0.0


RULES = {RewardKind.exact_match: exact_match, RewardKind.math_verify: math_verify_score}
