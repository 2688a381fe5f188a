"""Rollout sources: where the loop (`rlhf.driver.loop`) takes each step's batch from.

    Collect     the synchronous source: the step's rollouts generated when the step asks, by the weights
                the step before made (every sample on-policy)
    StaleSync   (`rlhf.driver.stale_sync`, stale_sync.max_staleness > 0) a producer thread generating ahead
                of the trainer within the staleness bound, its groups queued over DistQueue

A source is built before the run (`Run.start` hands its `wake` to the run's fault handling) and started
after the first evaluation. The loop owns restarts, evaluation, checkpoints and records; a source says
what is its own: how a step's batch is made, the devices' turn around training, what a checkpoint keeps
of it, and the metrics only it knows. A new source (multi-turn episodes, a replay buffer) implements
`RolloutSource`; CONTRIBUTING.md says how.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import ContextManager, Protocol

from rlhf.algorithms.correction import correction_stats
from rlhf.driver.rollout import Rollout, collect
from rlhf.parity import Parity, logprob_parity


class RolloutSource(Protocol):
    phase: str  # the name of the step's phase that gets its batch (`time/<phase>`)
    switches: bool  # co-located roles switch turns around each update (engines sleep, the trainer onloads)

    def wake(self) -> None:
        """Wake the main thread where it waits on this source (another thread asks it for something)."""

    def start(self, run) -> None:
        """Begin making batches for the steps after `run.step` (again after a trainer restart: from
        `run.last_checkpoint` or the run's resume directory)."""

    def batch(self, run, step: int) -> Rollout:
        """Step `step`'s rollouts."""

    def turn(self, run, step: int) -> ContextManager:
        """Held while the step trains and evaluates: the devices' turn where the source shares them."""

    def trained(self, run, step: int) -> None:
        """The engines serve the weights of `step` now."""

    def quiet(self) -> ContextManager:
        """Held while a checkpoint is written: the source's state stands still."""

    def state(self, d: Path) -> dict:
        """The source's part of checkpoint `d` (JSON-able; files beside it in `d`)."""

    def measure(self, run, step: int, ro: Rollout, learned) -> tuple[Parity, dict]:
        """The step's trainer/engine logprob parity and the source's own metrics."""

    def stop(self, timeout_s: float, restarting: BaseException | None = None) -> None:
        """Make no more batches (the run's end; a failure: timeout 0). `restarting`: the trainer restarts after
        `restarting`, and a source that cannot stop within `timeout_s` raises."""

    def result(self) -> dict:
        """The source's part of the run's result."""

    def close(self) -> None:
        """Release what the source holds (actors, threads); the run is over."""


class Collect:
    """The synchronous source: each step generates its own rollouts from the weights the step before made."""

    phase = "rollout"
    switches = True

    def wake(self) -> None:
        pass

    def start(self, run) -> None:
        pass

    def batch(self, run, step: int) -> Rollout:
        return collect(run.cfg, run.roles, run.inputs.sampler, run.inputs.tokenizer, step, run.route_stages)

    def turn(self, run, step: int) -> ContextManager:
        return nullcontext()

    def trained(self, run, step: int) -> None:
        pass

    def quiet(self) -> ContextManager:
        return nullcontext()

    def state(self, d: Path) -> dict:
        return {}

    def measure(self, run, step: int, ro: Rollout, learned) -> tuple[Parity, dict]:
        b = learned.batch
        return (logprob_parity(learned.old_logp, b.rollout_logp_BT, b.mask_BT),
                correction_stats(run.cfg.algorithm, learned.old_logp, b.rollout_logp_BT, b.mask_BT))

    def stop(self, timeout_s: float, restarting: BaseException | None = None) -> None:
        pass

    def result(self) -> dict:
        return {"samples_dropped": 0}

    def close(self) -> None:
        pass
