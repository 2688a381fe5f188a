"""What every configuration check reports: a `Problem` (key, value seen, what to change) and the
`ConfigError` that carries all problems of a config at once; and the faults a run stops on because it may
not survive them (more than its restart budgets). Pure; imports nothing of ours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class ConfigError(ValueError):
    """A configuration a run cannot use. The message says what to change."""


@dataclass(frozen=True)
class Problem:
    key: str
    value: object
    fix: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.fix}"


def raise_problems(problems: Sequence[Problem], what: str) -> None:
    """Raise one ConfigError listing every problem (nothing when there is none)."""
    if problems:
        lines = "\n  ".join(str(p) for p in problems)
        raise ConfigError(f"invalid {what} ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  {lines}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n > 0 else []


class EngineRestartsExhausted(RuntimeError):
    """More rollout engines died within the window than rollout.max_restarts allows (docs/faults.md)."""


class PolicyRestartRefused(RuntimeError):
    """A trainer or reference rank died and the run cannot restart them: no checkpoint, or none left."""


class ShortBatch(RuntimeError):
    """DAPO's dynamic sampling ran out of draws (`algorithm.max_draws`) short of the batch, with
    `algorithm.fail_short_batch`; the message says what to change."""
