"""Chaos for episodes: another environment whose calls now and then hang or raise.

`rlhf.agents.flaky:Flaky` wraps the environment named by `environment` (module:Class, with `environment_args`):
each reset and step first draws, and with probability `hang` sleeps `hang_s` seconds (a hung tool: the episode
must end as `timeout` at agent.step_timeout_s and the step go on), with probability `fail` raises (an
`env_error`), and otherwise passes the call on. To see a run, and one's own environment under it, survive both:

    rlhf train configs/tiny_cpu_retry.yaml agent.environment=rlhf.agents.flaky:Flaky \\
        'agent.environment_args={environment: rlhf.agents.retry:Retry, hang: 0.02, fail: 0.02}' agent.step_timeout_s=2
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, Mapping

from rlhf.agents.environment import Observation, load_environment

_made = itertools.count()  # each environment of a process draws its own sequence


class Flaky:
    def __init__(self, environment: str, environment_args: Mapping[str, Any] | None = None, hang: float = 0.0,
                 fail: float = 0.0, hang_s: float = 3600.0, seed: int = 0):
        if not (0 <= hang <= 1 and 0 <= fail <= 1 and hang + fail <= 1 and hang_s > 0):
            raise ValueError("Flaky: hang and fail are probabilities summing to at most 1, hang_s > 0")
        self.inner = load_environment(environment, environment_args)()
        self.stop = tuple(getattr(self.inner, "stop", ()))
        self.hang, self.fail, self.hang_s = hang, fail, hang_s
        self.rng = random.Random(seed * 1_000_003 + next(_made))

    def _chaos(self, call: str) -> None:
        x = self.rng.random()
        if x < self.hang:
            time.sleep(self.hang_s)
        elif x < self.hang + self.fail:
            raise RuntimeError(f"chaos: this {call} failed on purpose (rlhf.agents.flaky)")

    def reset(self, row) -> None:
        self._chaos("reset")
        self.inner.reset(row)

    def step(self, text: str) -> Observation:
        self._chaos("step")
        return self.inner.step(text)
