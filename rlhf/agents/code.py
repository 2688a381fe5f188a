"""The code task with feedback: the sandbox's verdict on a failing case comes back, and the model tries again.

A model turn is a program, run against the row's tests in the code verifier's sandbox (`rlhf.data.sandbox.check`,
`reward.kind: code`'s, with `sandbox`'s limits: docs/code_reward.md); a passing one ends the episode with reward
`decay ** (tries - 1)`, a failing one is answered with `feedback` filled in from the verdict and the model gets
another turn, up to `agent.max_turns`. The template's fields: `{status}` (failed, error, timeout, blocked),
`{detail}` (the failing case: what was expected and what came out, or the tail of stderr) and `{output}` (what
the program printed in that case). The default, `"={output}?"`, is written in the tiny world's alphabet; a
tokenizer with words takes `"Your program failed: {detail}. Try again."`.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Mapping

from rlhf.agents.environment import Observation

FIELDS = ("status", "detail", "output")
_slots: dict[int, threading.Semaphore] = {}  # per sandbox.processes: programs a process runs at once
_slots_lock = threading.Lock()


class CodeFeedback:
    stop: tuple[str, ...] = ()  # a turn is one program, ended by EOS

    def __init__(self, feedback: str = "={output}?", decay: float = 1.0, sandbox: Mapping[str, Any] | None = None,
                 max_output_chars: int = 16):
        from omegaconf import OmegaConf

        from rlhf.schema import SandboxConfig

        try:
            feedback.format(**{f: "" for f in FIELDS})
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"CodeFeedback: feedback {feedback!r} is not a template of {', '.join(FIELDS)} "
                             f"({type(e).__name__}: {e})") from None
        if not feedback or not 0 < decay <= 1:
            raise ValueError("CodeFeedback: feedback must be non-empty text and decay in (0, 1]")
        self.feedback, self.decay, self.max_output_chars = feedback, decay, max_output_chars
        try:
            self.sandbox = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SandboxConfig), dict(sandbox or {})))
        except Exception as e:
            raise ValueError(f"CodeFeedback: sandbox {dict(sandbox or {})} is not a reward.sandbox section "
                             f"({type(e).__name__}: {str(e).splitlines()[0]})") from None
        self.answer, self.tries = "", 0

    def check_machine(self) -> str | None:
        """Whether this machine can make the sandbox's box (asked by each environment worker as it starts, as a
        reward worker asks: a worker that cannot run programs fails the run's start, saying why)."""
        return _isolation_problem(self.sandbox)

    def reset(self, row) -> None:
        self.answer, self.tries = row.answer, 0

    def step(self, text: str) -> Observation:
        from rlhf.data.sandbox import check

        problem = _isolation_problem(self.sandbox)
        if problem:
            raise RuntimeError(problem)
        self.tries += 1
        with _slot(self.sandbox.processes):  # a worker steps every episode at once; its fork servers are `processes`
            verdict = check(text, self.answer, self.sandbox)
        if verdict.score >= 1.0:
            return Observation(done=True, reward=self.decay ** (self.tries - 1))
        output = verdict.output.strip()[: self.max_output_chars]
        return Observation(text=self.feedback.format(status=verdict.status, detail=verdict.detail, output=output))


@functools.lru_cache(maxsize=8)
def _isolation_problem(sandbox) -> str | None:
    """Whether this machine can make the sandbox's box (asked once per process, as a reward worker asks)."""
    from rlhf.data.sandbox_box import isolation_problem

    return isolation_problem(sandbox)


def _slot(processes: int) -> threading.Semaphore:
    with _slots_lock:
        return _slots.setdefault(max(1, processes), threading.Semaphore(max(1, processes)))
