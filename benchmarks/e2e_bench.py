"""End-to-end throughput of the RL step: `rlhf train` on a real-sized shape with long completions.

    python -m benchmarks.e2e_bench                       # configs/small_cpu.yaml: warm-up + 3 measured steps
    python -m benchmarks.e2e_bench --steps 5 trainer.dp=1 rollout.num_engines=1   # other layouts, overrides

Builds the policy first (random weights of the config's model shape and a tokenizer padded to its
vocabulary, with the tiny task's prompt files; our own code, once per shape under `model.path`), then
runs `rlhf.driver.train` with `--warmup` + `--steps` steps and a sampler of the whole process tree's
memory. The last line is one JSON object: `tokens_per_second` (generated tokens over the measured
steps' seconds, the run's final held-out evaluation left out), `seconds_per_step`, seconds per phase,
the update's and generation's floors and each phase over its floor (`update_floor_seconds`,
`update_over_floor`, `generate_floor_seconds`, `generate_over_floor`: benchmarks/floors.py, at the rates measured
here before the run, under `machine`), `sync_bytes_per_step`, `peak_memory_gib` (the machine's use above what it
used before the run, free pages in the kernel's per-CPU lists not counted; `peak_memory_gib_psutil` counts them, as
`free` does) and per role (resident memory by process title), and where the cores went in the measured steps:
`cpu_seconds_per_step` by role (user and system seconds of the role's processes), their sum and `cores_busy` (that
sum over the step's seconds times the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.outputs import keep_previous

REPO = Path(__file__).resolve().parents[1]


def build_policy(cfg) -> Path:
    """Random weights of `cfg.model`'s shape, a padded tokenizer and the tiny task's prompt files."""
    from rlhf.data.arithmetic import make_problems, write_jsonl
    from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
    from rlhf.model.hf_io import save_pretrained
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    d = Path(cfg.model.path)
    if not (d / "config.json").is_file():
        model = Qwen3MoeForCausalLM(cfg.model)
        model.init_weights(cfg.seed, std=0.02)
        save_tokenizer(build_tokenizer(cfg.model.vocab_size), d, model_max_length=cfg.model.max_position_embeddings)
        save_pretrained(model, d)
        train = make_problems(2048, seed=cfg.seed)
        write_jsonl(train, d / "train.jsonl")
        write_jsonl(make_problems(64, seed=cfg.seed + 1, exclude={p.prompt for p in train}), d / "heldout.jsonl")
    return d


def cpu_list_free_bytes(zoneinfo: str = "/proc/zoneinfo") -> int:
    """Free pages the kernel holds in its per-CPU lists (`count:` of every pageset in /proc/zoneinfo). MemFree
    leaves them out, so `free` and psutil count them as used; after a burst of frees (a sync's staging pages, a
    sleeping engine's weights) this kernel's lists grow to gigabytes (their `high_max` adds up to 3 GiB here) and
    drain back over seconds. 0 where the file cannot be read."""
    try:
        with open(zoneinfo) as f:
            counts = [line.split()[1] for line in f if line.lstrip().startswith("count:")]
    except OSError:
        return 0
    return sum(int(c) for c in counts) * os.sysconf("SC_PAGE_SIZE")


class MemorySampler:
    """Resident memory of this process and all its descendants (Ray workers, vLLM processes), sampled
    every `period` seconds; the peak, and each role's peak by process title (`ray::TrainerWorker`, ...). The
    machine's use is psutil's `used` less the free pages in the kernel's per-CPU lists (`cpu_list_free_bytes`);
    the peak of psutil's own figure is kept too (`peak_used_raw`). With `steps_file`, also each role's CPU
    seconds (user and system) between the samples that first see `warmup` and `total` lines in it: where the
    machine's cores went in the measured steps (`cpu_seconds`)."""

    ROLES = {"TrainerWorker": "trainer", "PolicyWorker": "reference", "VLLMEngine": "rollout", "VLLM": "rollout",
             "RewardWorker": "reward", "RuleRewardWorker": "reward", "DistQueue": "queue", "raylet": "ray",
             "gcs_server": "ray", "dashboard": "ray", "DashboardAgent": "ray", "log_monitor": "ray", "e2e_bench": "driver"}

    def __init__(self, period: float = 0.5, timeline: Path | None = None, steps_file: Path | None = None,
                 warmup: int = 0, total: int = 0):
        import psutil

        self.psutil, self.period, self.timeline = psutil, period, timeline
        self.idle_raw = psutil.virtual_memory().used
        self.idle = self.idle_raw - cpu_list_free_bytes()
        self.peak_used, self.peak_used_raw, self.peak_tree, self.peak_roles = 0, 0, 0, {}
        self.roles_at_peak: dict[str, int] = {}  # each role's memory when the machine's use peaked
        self.steps_file, self.marks = steps_file, (warmup, total)
        self.cpu_of: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds when last seen)
        self.cpu_at: list[dict[str, float]] = []  # each role's CPU seconds at the marks reached
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._out = open(self.timeline, "w") if self.timeline else None  # a bad path fails here, before the run
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        me = self.psutil.Process()
        t0 = time.time()
        try:
            while not self._stop.wait(self.period):
                self._sample(me, t0, self._out)
        finally:
            if self._out:
                self._out.close()

    def _sample(self, me, t0: float, out) -> None:
        try:
            procs = [me] + me.children(recursive=True)
        except self.psutil.Error:
            return
        roles: dict[str, int] = {}
        tree = 0
        for p in procs:
            try:
                rss, title, cpu = p.memory_info().rss, " ".join(p.cmdline()[:3]), p.cpu_times()
            except self.psutil.Error:
                continue
            tree += rss
            role = next((r for key, r in self.ROLES.items() if key in title), "other")
            roles[role] = roles.get(role, 0) + rss
            self.cpu_of[p.pid] = (role, cpu.user + cpu.system)
        self._mark()
        raw = self.psutil.virtual_memory().used
        lists = cpu_list_free_bytes()
        used = raw - lists
        self.peak_tree, self.peak_used_raw = max(self.peak_tree, tree), max(self.peak_used_raw, raw)
        if used > self.peak_used:
            self.peak_used, self.roles_at_peak = used, roles
        for role, b in roles.items():
            self.peak_roles[role] = max(self.peak_roles.get(role, 0), b)
        if out:
            gib = 1 << 30
            out.write(json.dumps({"t": round(time.time() - t0, 1), "used_gib": round((used - self.idle) / gib, 3),
                                  "cpu_lists_gib": round(lists / gib, 3),
                                  **{r: round(b / gib, 3) for r, b in sorted(roles.items())}}) + "\n")
            out.flush()

    def _mark(self) -> None:
        """Each role's CPU seconds so far, once the steps file first holds as many lines as the next mark."""
        if self.steps_file is None or len(self.cpu_at) == len(self.marks):
            return
        try:
            lines = self.steps_file.read_bytes().count(b"\n")
        except OSError:
            lines = 0
        if lines >= self.marks[len(self.cpu_at)]:
            by_role: dict[str, float] = {}
            for role, seconds in self.cpu_of.values():
                by_role[role] = by_role.get(role, 0.0) + seconds
            self.cpu_at.append(by_role)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each role spent between the two marks (empty if the run did not reach both)."""
        if len(self.cpu_at) < 2:
            return {}
        start, end = self.cpu_at
        return {r: end[r] - start.get(r, 0.0) for r in sorted(end) if end[r] - start.get(r, 0.0) > 0}


def hidden_share(phases: dict[str, float]) -> dict[str, float]:
    """Under StaleSync the generate phase runs beside the trainer's work, and `generate_over_floor` then reads a
    phase stretched by the cores it shares: `generate_hidden_share` is the part of it the trainer did not wait for
    (1 - time/wait_for_rollouts over time/generate). Nothing for the synchronous loop."""
    if "wait_for_rollouts" not in phases or not phases.get("generate"):
        return {}
    return {"generate_hidden_share": round(max(0.0, 1 - phases["wait_for_rollouts"] / phases["generate"]), 3)}


def cpu_shares(cpu: dict[str, float], steps: int, seconds: float) -> dict:
    """Where the cores went in the measured steps: CPU seconds a step by role, their sum, and that sum over the
    step's seconds times the cores this process may use (`cores_busy`: 1.0 is every core busy all the step)."""
    if not cpu or not steps or not seconds:
        return {}
    total = sum(cpu.values())
    return {"cpu_seconds_per_step": {r: round(v / steps, 2) for r, v in cpu.items()},
            "cpu_seconds_per_step_total": round(total / steps, 2),
            "cores_busy": round(total / (seconds * len(os.sched_getaffinity(0))), 3)}


def measured(steps: list[dict]) -> tuple[float, int, dict[str, float]]:
    """(step seconds, generated tokens, mean seconds per phase) of the measured steps' records. A step's
    seconds leave out its held-out evaluation (the run's last step ends with one), as `rlhf train`'s
    tokens_per_second does: the benchmark measures the RL step."""
    seconds = sum(s["time/step"] - s.get("time/evaluate", 0.0) for s in steps)
    phases: dict[str, float] = {}
    for s in steps:
        for k, v in s.items():
            if k.startswith("time/"):
                phases[k[5:]] = phases.get(k[5:], 0.0) + v / len(steps)
    return seconds, sum(s["rollout/generated_tokens"] for s in steps), phases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "small_cpu.yaml"))
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--memory-timeline", type=Path, default=None,
                        help="write every memory sample (machine use above idle, each role's resident GiB) as jsonl")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
    args = parser.parse_args(argv)
    if args.memory_timeline and not args.memory_timeline.resolve().parent.is_dir():
        parser.error(f"--memory-timeline {args.memory_timeline}: its folder does not exist; create it or give another")

    from rlhf.config import ConfigError, load_run_config
    from rlhf.cpu_matmul import compute_dtype_problem
    from rlhf.driver import train
    from rlhf.host_allocator import allocator_env, allocator_name

    total = args.warmup + args.steps
    try:
        cfg = load_run_config(args.config, [*args.overrides, f"steps={total}", f"eval_every={total + 1000}"])
    except ConfigError as e:
        parser.error(str(e))
    problem = compute_dtype_problem(cfg.model, cfg.trainer, cfg.placement.device_type)
    if problem:  # before the policy is built and the machine probed
        parser.error(problem)
    build_policy(cfg)
    import torch

    from benchmarks.floors import machine_rates, phase_floors

    # this machine's rates, measured before the run with nothing else running: the phases' floors
    rates = machine_rates(getattr(torch, (cfg.trainer.compute_dtype or cfg.model.dtype).value))
    keep_previous(cfg.output_dir)  # a fresh run: no earlier steps or checkpoints in its way
    gib = 1 << 30
    steps_file = Path(cfg.output_dir) / "steps.jsonl"
    with MemorySampler(timeline=args.memory_timeline, steps_file=steps_file, warmup=args.warmup, total=total) as mem:
        t0 = time.time()
        result = train(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
        wall = time.time() - t0
    lines = steps_file.read_text().splitlines()
    steps = [json.loads(line) for line in lines][args.warmup:]  # this run's steps
    seconds, tokens, phases = measured(steps)
    trained = sum(s["throughput/step_tokens_per_s"] * s["time/step"] for s in steps) / len(steps)
    decode_steps = sum(s["response/length_max"] for s in steps) / len(steps)
    floors = phase_floors(cfg, rates, phases["update"], phases["generate"], trained, decode_steps)
    out = {"config": args.config, "overrides": args.overrides, "warmup": args.warmup, "steps": len(steps),
           "tokens_per_second": round(tokens / seconds, 1), "seconds_per_step": round(seconds / len(steps), 2),
           "generated_tokens_per_step": tokens / len(steps),
           "phase_seconds": {k: round(v, 3) for k, v in sorted(phases.items())},
           **floors, **hidden_share(phases), "machine": {k: round(v, 3) for k, v in rates.items()},
           "sync_bytes_per_step": result["sync_bytes_per_step"], "sync_share": result["sync_share"],
           "peak_memory_gib": round((mem.peak_used - mem.idle) / gib, 2),
           "peak_memory_gib_psutil": round((mem.peak_used_raw - mem.idle_raw) / gib, 2),
           "peak_tree_rss_gib": round(mem.peak_tree / gib, 2),
           "peak_memory_gib_per_role": {r: round(b / gib, 2) for r, b in sorted(mem.peak_roles.items())},
           "roles_at_peak_gib": {r: round(b / gib, 2) for r, b in sorted(mem.roles_at_peak.items())},
           **cpu_shares(mem.cpu_seconds(), len(steps), seconds), "wall_seconds": round(wall, 1),
           **({"trainer_allocator": allocator_name(allocator_env(cfg.trainer.cpu_allocator.value))}
              if cfg.placement.device_type.value == "cpu" else {})}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
