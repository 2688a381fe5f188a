"""A verifiable task: integer addition with a unique answer, and its exact-match verifier.

Prompts look like `347+58=`; the answer is the decimal sum (`405`). Problems are drawn from a
seeded generator, de-duplicated, and split so that held-out problems never appear in training.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def _draw(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def make_problems(n: int, seed: int, max_digits: int = 3, exclude: set[str] = frozenset()) -> list[Problem]:
    """`n` distinct addition problems with operands of 1..max_digits digits, none whose prompt is in `exclude`."""
    space = (10**max_digits) ** 2
    if n + len(exclude) > space:
        raise ValueError(f"asked for {n} distinct problems but only {space} exist with max_digits={max_digits}")
    rng = random.Random(seed)
    seen, out = set(exclude), []
    while len(out) < n:
        a, b = _draw(rng, max_digits), _draw(rng, max_digits)
        prompt = f"{a}+{b}="
        if prompt not in seen:
            seen.add(prompt)
            out.append(Problem(prompt, str(a + b)))
    return out


_LEADING_INT = re.compile(r"^\s*(-?\d+)")


def is_correct(response: str, answer: str) -> bool:
    """Exact match of the response's leading integer with the answer; trailing text after it is ignored."""
    m = _LEADING_INT.match(response)
    return m is not None and m.group(1) == answer.strip()


def write_jsonl(problems: list[Problem], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for p in problems:
            f.write(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n")
    return path
