"""What a run has done, for its logs and its result: each step's metrics (W&B, steps.jsonl, the progress
line), the driver's phases and their time, the held-out accuracy history, and the final result
(result.json). The `Recorder` is one component of `rlhf.driver.run.Run`; it reads nothing of the others.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from rlhf.driver.metrics import progress_fields
from rlhf.tracking import Progress, Tracker

# the few metrics of each step the result is made of (every metric goes to steps.jsonl and W&B)
KEPT = ("reward/mean", "accuracy/train", "parity/max_abs_diff", "parity/mean_abs_diff", "parity/p99_abs_diff",
        "time/step", "time/sync", "time/sync_transfer", "time/sync_install", "sync/bytes_received", "sync/bytes_shm",
        "rollout/generated_tokens")


@dataclass
class Recorder:
    tracker: Tracker
    steps_file: Path  # every metric of every step, one JSON line each, readable as the run goes
    total_steps: int
    progress: Optional[Progress] = None  # the progress line, from the step the run starts at (`begin`)
    history: list[dict] = field(default_factory=list)  # the KEPT metrics per step, for the result
    accuracy: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out accuracy)
    accuracy_seconds: list[float] = field(default_factory=list)  # when each was measured, from the run's start
    eval_seconds: dict[int, float] = field(default_factory=dict)  # how long the evaluation after each step took
    phase_seconds: dict[str, float] = field(default_factory=dict)  # this step's driver phases
    parity_violations: int = 0  # steps whose trainer/engine logprobs differed beyond the run's limit
    sync_seconds: float = 0.0  # summed over steps, for the sync's share of the run
    step_seconds: float = 0.0
    train_seconds: float = 0.0  # step time less evaluation: what throughput is measured over
    last_sync: Optional[object] = None  # the last step's weight sync (`SyncReplies`): bytes per engine rank
    t0: float = field(default_factory=time.time)

    def begin(self, start_step: int) -> None:
        self.progress = Progress(self.total_steps, start_step=start_step)

    @contextmanager
    def phase(self, name: str, step: int):
        """Time a driver phase: a trace event and the step's `time/<phase>` metric."""
        t0 = time.time()
        with self.tracker.trace.phase(name, "driver", step):
            yield
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.time() - t0

    def evaluated(self, step: int, acc: float, seconds: float) -> None:
        self.eval_seconds[step] = seconds
        self.accuracy.append((step, acc))
        self.accuracy_seconds.append(round(time.time() - self.t0, 1))

    def add(self, step: int, m: dict, seconds: float, samples: int, parity_problem: str | None = None,
            sync=None) -> None:
        """Step `step`'s metrics `m` (this step's phases are added here and then start afresh);
        `parity_problem`: the trainer and the engines disagreed beyond the run's limit, and how; `sync`: the
        step's weight sync (`SyncReplies`)."""
        self.parity_violations += parity_problem is not None
        self.last_sync = sync
        self.sync_seconds += self.phase_seconds.get("weight sync", m["time/sync"])  # what the loop waited
        self.step_seconds += seconds
        self.train_seconds += seconds - self.eval_seconds.get(step, 0.0)
        m.update({f"time/{k.replace(' ', '_')}": v for k, v in self.phase_seconds.items()})
        self.phase_seconds = {}
        self.tracker.log(m, step)
        with self.steps_file.open("a") as f:
            f.write(json.dumps({"step": step} | m) + "\n")
        self.history.append({k: m[k] for k in KEPT}
                            | {"step": step, "samples": samples, "staleness_max": m.get("stale/staleness_max", 0),
                               "route_mismatch": m.get("route/mismatch"),
                               "ep_rank_load": m.get("expert_load/ep_rank_max_over_mean"),
                               "experts_moved": m.get("expert_balance/experts_moved", 0),
                               "expert_bytes_moved": m.get("expert_balance/bytes_moved", 0),
                               "engine_layers_replaced": m.get("expert_balance/engine_layers_replaced", 0),
                               "route_tokens_any_mismatch": m.get("route/tokens_any_mismatch")})
        self.progress.update(step, progress_fields(m, self.accuracy))

    def redo_after(self, step: int) -> None:
        """The steps after `step` are done again (a trainer restart): their records go, and the phases of the
        step that failed but for the restart itself."""
        self.phase_seconds = {k: v for k, v in self.phase_seconds.items() if k == "trainer restart"}
        self.history = [h for h in self.history if h["step"] <= step]
        kept = [i for i, (s, _) in enumerate(self.accuracy) if s <= step]
        self.accuracy = [self.accuracy[i] for i in kept]
        self.accuracy_seconds = [self.accuracy_seconds[i] for i in kept]

    def result(self, acc_start: float) -> dict:
        """The run's summary from its steps' records: rewards, parity, routing, expert load, sync time and
        throughput (the caller adds what the other components know)."""
        h = self.history
        rewards = [x["reward/mean"] for x in h]
        k = max(1, len(rewards) // 4)
        return {
            "steps": self.total_steps, "steps_run": len(h),
            "heldout_accuracy_start": acc_start, "heldout_accuracy_end": self.accuracy[-1][1],
            "heldout_accuracy_history": self.accuracy,
            "heldout_accuracy_seconds": self.accuracy_seconds,
            "reward_first_quarter": sum(rewards[:k]) / k if rewards else None,
            "reward_last_quarter": sum(rewards[-k:]) / k if rewards else None,
            "parity_max_abs_diff": max((x["parity/max_abs_diff"] for x in h), default=None),
            "parity_mean_abs_diff_max": max((x["parity/mean_abs_diff"] for x in h), default=None),
            "parity_p99_abs_diff_max": max((x["parity/p99_abs_diff"] for x in h), default=None),
            "parity_violations": self.parity_violations,
            # routing (rollout.capture_routes): the trainer's own top-k against the engine's, mean over steps
            "route_mismatch_mean": _mean((x["route_mismatch"] for x in h if x["route_mismatch"] is not None), 6),
            "route_tokens_any_mismatch_mean": _mean((x["route_tokens_any_mismatch"] for x in h
                                                     if x["route_tokens_any_mismatch"] is not None), 6),
            # expert-parallel load (tokens on the busiest EP rank over the mean, the worst MoE layer), mean over
            # steps; and what expert-load balancing moved (trainer.expert_balance)
            "ep_rank_load_max_over_mean_mean": _mean((x["ep_rank_load"] for x in h if x["ep_rank_load"] is not None),
                                                     4),
            "expert_balance_experts_moved": sum(x["experts_moved"] for x in h),
            "expert_balance_bytes_moved": sum(x["expert_bytes_moved"] for x in h),
            # MoE layers whose engine placement followed (engines with ep > 1), summed over the balancing steps
            "expert_balance_engine_layers_replaced": sum(x["engine_layers_replaced"] for x in h),
            "syncs": len(h),
            "sync_share": round(self.sync_seconds / self.step_seconds, 4) if self.step_seconds else None,
            "sync_seconds_mean": _mean(x["time/sync"] for x in h),
            "sync_transfer_seconds_mean": _mean(x["time/sync_transfer"] for x in h),
            "sync_install_seconds_mean": _mean(x["time/sync_install"] for x in h),
            # throughput over the steps' time, start-up and evaluation excluded
            "tokens_per_second": _ratio(sum(x["rollout/generated_tokens"] for x in h), self.train_seconds),
            "samples_per_second": _ratio(sum(x["samples"] for x in h), self.train_seconds),
            "seconds_per_step": _ratio(self.train_seconds, len(h)),
            "staleness_max": max((x["staleness_max"] for x in h), default=None),
            "seconds": round(time.time() - self.t0, 1),
        }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _mean(values, digits: int = 4) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), digits) if values else None
