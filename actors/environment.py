"""Environment workers: the run's environments (`agent.environment`) in Ray actors of their own, placed like every
role (`placement.environment`, `agent.workers` of them), many episodes per worker at once.

`EnvironmentWorker` holds one environment per episode key; `reset` and `step` take a batch and run its calls at
once on threads under the step timeout (`rlhf.agents.runner.call_within`), observations checked in the worker.
`EnvironmentPool` is what the episode runner talks to (`rlhf.agents.runner.Environments`): episode k lives on
worker k % n; a worker that dies, or does not answer within its deadline, is killed and started again on its slot,
and its episodes in that call come back `lost` (the runner begins them again from their prompts).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

from actors.remote import RoleHandle, call_each
from rlhf.agents.runner import LocalEnvironments, Outcome

# A worker's call may take the step timeout, plus this, before the worker counts as hung: Ray's round trip and
# the threads' start on a loaded machine.
CALL_MARGIN_S = 30.0


class EnvironmentWorker:
    """One Ray actor's environments, made from `spec` (module:Class) and `kwargs`, one per episode key."""

    def __init__(self, spec: str, kwargs: dict, timeout_s: float):
        from rlhf.agents.environment import load_environment

        make = load_environment(spec, kwargs)
        check = getattr(make(), "check_machine", None)  # an environment that needs something of the machine
        problem = check() if callable(check) else None
        if problem:
            raise RuntimeError(f"environment {spec} cannot run on this worker's machine: {problem}")
        self.envs = LocalEnvironments(make, timeout_s)

    def pid(self) -> int:
        return os.getpid()

    def reset(self, keys: Sequence[int], rows: Sequence[Any]) -> list[Outcome]:
        """Fresh environments for `keys`, each reset from its row (a key already held is replaced)."""
        return self.envs.reset(keys, rows)

    def step(self, keys: Sequence[int], texts: Sequence[str]) -> list[Outcome]:
        return self.envs.step(keys, texts)

    def close(self, keys: Sequence[int] | None = None) -> None:
        """Drop the environments of `keys` (their episodes are over; None: every one)."""
        self.envs.close(keys)

    def release(self) -> None:
        """Called before the worker is killed: every environment dropped, and what their programs ran with let go
        (`rlhf.leftovers.release_programs`)."""
        from rlhf.leftovers import release_programs

        self.envs.close(None)
        release_programs()


class EnvironmentPool:
    """The run's environment workers as one `Environments`. `start_worker(i)`: worker i on its placement slot
    (`actors.roles.Roles.start_environment`); `inject(phase)`: chaos, called as a phase's calls go out."""

    def __init__(self, workers: list[RoleHandle], start_worker: Callable[[int], RoleHandle], stop: Sequence[str],
                 timeout_s: float, log: Callable[[str], None] = print,
                 inject: Callable[[str], None] = lambda phase: None):
        self.workers, self.start_worker, self.stop = workers, start_worker, tuple(stop)
        self.timeout_s, self.log, self.inject = timeout_s, log, inject
        self.replaced = 0  # workers started again after they died or hung
        self.lock = threading.Lock()  # two threads' batches at once (StaleSync's producer, an evaluation)

    def reset(self, keys: Sequence[int], rows: Sequence[Any]) -> list[Outcome]:
        return self._fan_out("reset", keys, rows)

    def step(self, keys: Sequence[int], texts: Sequence[str]) -> list[Outcome]:
        return self._fan_out("step", keys, texts)

    def close(self, keys: Sequence[int] | None = None) -> None:
        """Drop the environments of `keys` on their workers (None: every environment of every worker). A worker
        that fails here is left to the next batch's calls, which replace it."""
        n = len(self.workers)
        mine = [None if keys is None else [k for k in keys if k % n == w] for w in range(n)]
        call_each([(h, "close", (m,), {}) for h, m in zip(list(self.workers), mine) if m is None or m],
                  timeout_s=self.timeout_s + CALL_MARGIN_S)

    def _fan_out(self, method: str, keys: Sequence[int], items: Sequence[Any]) -> list[Outcome]:
        workers = list(self.workers)  # the handles called (another thread may replace one meanwhile)
        n = len(workers)
        mine = [[i for i, k in enumerate(keys) if k % n == w] for w in range(n)]
        busy = [w for w in range(n) if mine[w]]
        calls = [(workers[w], method, ([keys[i] for i in mine[w]], [items[i] for i in mine[w]]), {})
                 for w in busy]
        replies = call_each(calls, timeout_s=self.timeout_s + CALL_MARGIN_S,
                            on_submit=lambda: self.inject(f"env_{method}"))
        out: list[Outcome] = [Outcome("lost")] * len(keys)
        for w, reply in zip(busy, replies):
            if isinstance(reply, Exception):
                self._replace(w, workers[w], reply)
                continue  # its episodes stay `lost`
            for i, o in zip(mine[w], reply):
                out[i] = o
        return out

    def _replace(self, w: int, failed: RoleHandle, error: Exception) -> None:
        """Worker w (the handle `failed`) died, hung or failed a call: its environments are gone; a new worker takes
        its slot, once, whichever thread's calls found it first."""
        with self.lock:
            if self.workers[w] is not failed:  # already replaced for another thread's batch
                return
            self.log(f"environment worker {w}: {error}; starting a new one, its episodes begin again")
            failed.kill(hung=True)
            self.workers[w] = self.start_worker(w)
            self.replaced += 1
