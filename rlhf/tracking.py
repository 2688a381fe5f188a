"""What a run reports while it runs: metrics to W&B (`Tracker`), a timeline of every phase on every
device as a Chrome trace (`Trace`), and a one-line progress bar on the console (`Progress`).

None of them imports ray or torch; the driver owns one of each. Actors time their own phases and
hand the driver (name, time.time() start, duration), which it adds to the trace.

Secrets: the W&B API key is wandb's business (WANDB_API_KEY or `wandb login`). Nothing here reads
the environment, and the run config sent to W&B is the `run_config` dict the driver passes, so no
environment value reaches the run, the trace or the console.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from rlhf.schema import TrackingConfig, TrackingMode


STEP_KEY = "train/step"  # the run's step, logged with every row


class Tracker:
    """One W&B run: the run config once, then `log(metrics, step)` per step, then `finish()`.

    `cfg.mode`: offline (default) writes a run folder `<cfg.dir>/wandb/offline-run-*` and needs no
    network; upload it later with `wandb sync`. online streams to W&B with the API key from the
    environment or `wandb login`. disabled does nothing and never imports wandb. wandb prints only
    to stderr, and its capture of our console output is off.
    """

    def __init__(self, cfg: TrackingConfig, run_config: dict[str, Any]):
        """`run_config`: the whole run's config as plain values (`rlhf.config.load.as_dict`)."""
        self._run = None
        self._run_dir: Optional[str] = None
        if cfg.mode is TrackingMode.disabled:
            return
        root = Path(cfg.dir).resolve()  # relative to the working directory, like every path in the config
        root.mkdir(parents=True, exist_ok=True)  # wandb falls back to a temp dir if it is missing
        wandb = _import_wandb(root)
        try:
            self._run = wandb.init(
                project=cfg.project,
                name=cfg.run_name,
                dir=str(root),
                mode=cfg.mode.value,
                config=run_config,
                reinit="create_new",  # one run per Tracker, never a global one left over from a test
                settings=wandb.Settings(console="off", quiet=True, show_info=False),
            )
        except wandb.errors.UsageError as e:
            if cfg.mode is TrackingMode.online:
                raise RuntimeError(
                    f"tracking.mode=online: W&B refused to start ({e}). Export WANDB_API_KEY or run "
                    "`wandb login`, or set tracking.mode=offline and upload later with `wandb sync`."
                ) from e
            raise
        self._run_dir = self._run.sync_dir
        # Every metric is charted against the run's step (STEP_KEY), not W&B's own row counter: a step redone
        # after a trainer restart is logged again at its step (W&B refuses rows below its counter) and the
        # later row is the one that counts, as in steps.jsonl.
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` at `step` (as STEP_KEY, W&B's x axis for every metric). Keys may hold slashes
        ("time/generate"): W&B groups by prefix. A step may be logged again (a redone step)."""
        if self._run is not None:
            self._run.log(dict(metrics) | {STEP_KEY: step})

    def finish(self, exit_code: int = 0) -> Optional[str]:
        """Close the run (a non-zero `exit_code` marks it failed); returns `run_dir`. Idempotent."""
        if self._run is not None:
            self._run.finish(exit_code=exit_code)
            self._run = None
        return self._run_dir

    @property
    def run_dir(self) -> Optional[str]:
        """The run's folder (`.../wandb/offline-run-*` offline, `run-*` online); None when disabled."""
        return self._run_dir


def _import_wandb(root: Path):
    """wandb, imported here so that a disabled run never pays for (or depends on) it. Its first import makes two
    temp directories (media and artifact staging, `tmp*wandb-media` and `tmp*wandb-artifacts`) that it removes at
    a normal exit only: a driver killed with SIGKILL left them in /tmp. Made in the run's tracking directory
    instead (`root`), they stay with the run's output where a kill leaves them."""
    if "wandb" not in sys.modules:
        from rlhf.leftovers import temp_dir

        with temp_dir(root):
            import wandb  # noqa: F401
    return sys.modules["wandb"]


class Trace:
    """Phases of the driver loop as a Chrome trace (open it in https://ui.perfetto.dev).

    A track names where a phase ran as "PROCESS/THREAD": "device 0/trainer r0", "device 1/engine 0",
    or a bare "driver" (process and thread both "driver"). Each process becomes a trace process and
    each thread a row under it, sorted naturally (driver first, then device 0, 1, ..., 10).

    Times are wall-clock seconds since the epoch (`time.time()`), so phases timed in other
    processes line up with the driver's; durations may come from any clock (`perf_counter`
    differences are best). Every event's args hold `step` and the extra numbers given.
    """

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._events: list[tuple[str, str, str, float, float, dict[str, Any]]] = []

    @contextmanager
    def phase(self, name: str, track: str, step: int, **args: Any) -> Iterator[None]:
        """Time the block as one event on `track`; recorded even if the block raises."""
        if not self.enabled:
            yield
            return
        start_s, t0 = time.time(), time.perf_counter()
        try:
            yield
        finally:
            self.add(name, track, start_s, time.perf_counter() - t0, step, **args)

    def add(self, name: str, track: str, start_s: float, dur_s: float, step: int, **args: Any) -> None:
        """Record a phase timed elsewhere: it started at `start_s` (time.time()) and took `dur_s`."""
        if not self.enabled:
            return
        process, thread = _split_track(track)
        self._events.append((name, process, thread, start_s, dur_s, {"step": step, **args}))

    def save(self) -> Optional[str]:
        """Write the trace (replacing the file whole, so saving every step is safe); returns the path,
        None when disabled."""
        if not self.enabled:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, default=_json_scalar)
        os.replace(tmp, self.path)
        return str(self.path)

    def to_json(self) -> dict[str, Any]:
        """The trace as Chrome's JSON object format: metadata naming processes and threads, then
        complete ("X") events in microseconds, parents before the phases nested in them."""
        processes = sorted({p for _, p, _, _, _, _ in self._events}, key=_natural_key)
        pid = {p: i + 1 for i, p in enumerate(processes)}
        tid: dict[tuple[str, str], int] = {}
        for p in processes:
            threads = sorted({t for _, p2, t, _, _, _ in self._events if p2 == p}, key=_natural_key)
            tid.update({(p, t): i + 1 for i, t in enumerate(threads)})

        meta = []
        for p in processes:
            meta.append(_meta("process_name", pid[p], 0, {"name": p}))
            meta.append(_meta("process_sort_index", pid[p], 0, {"sort_index": pid[p]}))
        for (p, t), i in tid.items():
            meta.append(_meta("thread_name", pid[p], i, {"name": t}))
            meta.append(_meta("thread_sort_index", pid[p], i, {"sort_index": i}))
        events = [
            {"name": name, "ph": "X", "ts": round(start_s * 1e6, 3), "dur": round(dur_s * 1e6, 3),
             "pid": pid[p], "tid": tid[(p, t)], "args": args}
            for name, p, t, start_s, dur_s, args in self._events
        ]
        events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


class Progress:
    """One console line per step: `[#####-----] 12/30 reward 0.41 acc 0.35 3.1 s/step eta 1m10s`.

    On a terminal the line is redrawn in place (carriage return); elsewhere (CI, Ray job logs) each
    update prints a plain line. `stream` defaults to sys.stderr, keeping stdout for results.
    Seconds per step average over the steps done since `start_step` (where a resumed run began).
    """

    BAR_WIDTH = 20

    def __init__(self, total_steps: int, start_step: int = 0, stream: Optional[TextIO] = None,
                 enabled: bool = True):
        self.total_steps = total_steps
        self.start_step = start_step
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self._tty = _isatty(self.stream)
        self._t0 = time.perf_counter()
        self._drawn = False

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Show that `step` steps are done (of `total_steps`) and the given metrics."""
        if not self.enabled:
            return
        line = self.render(step, metrics, time.perf_counter() - self._t0)
        if self._tty:
            width = shutil.get_terminal_size().columns - 1  # a wrapped line cannot be redrawn
            self.stream.write("\r" + line[:width] + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._drawn = True

    def render(self, step: int, metrics: dict[str, float], elapsed_s: float) -> str:
        total = max(self.total_steps, 1)
        filled = min(self.BAR_WIDTH, max(0, round(self.BAR_WIDTH * step / total)))
        parts = [f"[{'#' * filled}{'-' * (self.BAR_WIDTH - filled)}] {step}/{self.total_steps}"]
        parts += [f"{k} {_fmt(v)}" for k, v in metrics.items()]
        done = step - self.start_step
        if done > 0:
            per_step = elapsed_s / done
            eta_s = per_step * max(self.total_steps - step, 0)
            parts.append(f"{_fmt(per_step)} s/step eta {_duration(eta_s)}")
        return " ".join(parts)

    def close(self) -> None:
        """End the redrawn line so what follows starts on a fresh one."""
        if self.enabled and self._tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
        self._drawn = False


def _split_track(track: str) -> tuple[str, str]:
    process, _, thread = (s.strip() for s in track.partition("/"))
    if not process:
        raise ValueError(
            f"trace track {track!r} has no process name: write 'PROCESS/THREAD' "
            "(e.g. 'device 0/trainer r0') or 'driver'"
        )
    return process, thread or process


def _natural_key(name: str) -> tuple:
    # Names without a number (driver) first, then "device 2" before "device 10".
    parts = [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]
    return (any(isinstance(p, int) for p in parts), [(isinstance(p, str), p) for p in parts])


def _meta(kind: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _json_scalar(x: Any) -> Any:
    # numpy and torch scalars (and 0-d tensors) have .item(); anything else is shown as text.
    return x.item() if hasattr(x, "item") else str(x)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _fmt(x: Any) -> str:
    if isinstance(x, (bool, int, str)):
        return str(x)
    try:
        return f"{float(x):.3g}"  # also numpy and torch scalars
    except (TypeError, ValueError):
        return str(x)


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
