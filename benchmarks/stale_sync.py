"""StaleSync side by side: the same run at staleness 0 (the synchronous loop), 1 and 2, on the same machine.

    python -m benchmarks.stale_sync                          # configs/tiny_cpu_disaggregated.yaml, 40 steps
    python -m benchmarks.stale_sync --rounds 2 --staleness 0 1
    python -m benchmarks.stale_sync --staleness 0 2 --partial   # also staleness 2 with partial rollouts
    python -m benchmarks.stale_sync --config configs/tiny_cpu.yaml --staleness 0 1 \
        --set algorithm.tis_cap=2 rollout.sleep_level=1          # co-located: the roles take turns
    python -m benchmarks.stale_sync --staleness 0 1 --seeds 0 1 2 3   # a round per seed: accuracy over seeds

Each run is `rlhf train CONFIG stale_sync.max_staleness=K eval_every=E` in its own process (own embedded Ray),
the staleness values interleaved round by round so each sees the same machine. Outputs go under
`out/stale_sync_bench/` (a previous benchmark's are kept beside it). Per run: generated tokens per second and
samples per second over the steps' time (start-up and evaluation excluded: `rlhf train`'s own figures),
seconds per step, the mean seconds of each phase from step 3 on (`phase_seconds_mean`), the largest
staleness trained on, samples dropped, and held-out accuracy against seconds since the first evaluation.
The summary gives each staleness's throughput over staleness 0's (medians over rounds) and, at each
evaluation of the asynchronous run, the synchronous run's accuracy at that same wall-clock time (its last
evaluation by then). Every run of a seed is deterministic, so rounds of one seed repeat the same learning;
`--seeds` gives each round its own seed (`seed=`), and the summary then adds `equal_time`: over the rounds,
the asynchronous run's accuracy minus the synchronous run's at the same wall-clock time, at each of its
evaluations (mean, and how many higher / equal / lower) and at its last one. Writes `accuracy_vs_time.svg`
beside the outputs. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.outputs import keep_previous

REPO = Path(__file__).resolve().parents[1]
OUT = Path("out/stale_sync_bench")
PHASES = ("step", "generate", "wait_for_rollouts", "old_logprobs", "update", "weight_sync")


def run_once(config: Path, staleness: int, out: Path, steps: int | None, eval_every: int,
             partial: bool = False, extra: tuple[str, ...] = ()) -> dict:
    overrides = [*extra, f"stale_sync.max_staleness={staleness}", f"eval_every={eval_every}", f"output_dir={out}",
                 f"tracking.dir={out}", f"checkpoint.dir={out / 'ckpt'}", "checkpoint.export_hf=false"]
    overrides += ["stale_sync.partial_rollout=true"] if partial else []
    overrides += [f"steps={steps}"] if steps else []
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlhf.cli", "train", str(config), *overrides],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        return {"failed": proc.returncode, "stderr_tail": proc.stderr.strip().splitlines()[-5:]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    t_eval = r["heldout_accuracy_seconds"]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()][2:]  # after warm-up
    return {"staleness": staleness, "partial_rollout": partial, "seconds": round(time.time() - t0, 1),
            "steps": r["steps_run"],
            "tokens_per_second": r["tokens_per_second"], "samples_per_second": r["samples_per_second"],
            "seconds_per_step": r["seconds_per_step"], "staleness_max": r["staleness_max"],
            "samples_dropped": r["samples_dropped"], "sync_share": r["sync_share"],
            "parity_max_abs_diff": r["parity_max_abs_diff"],
            # where a step's time goes: the mean of each phase over steps 3 on (generation runs beside the
            # trainer's phases when staleness > 0)
            "phase_seconds_mean": {k: round(statistics.mean(m.get(f"time/{k}", 0.0) for m in steps), 3)
                                   for k in PHASES} if steps else {},
            # co-located roles taking turns: the seconds a step's trainer and producer waited for the devices
            "turn_wait_seconds_mean": {side: round(statistics.mean(m[f"stale/turn_wait_seconds_{side}"] for m in steps), 3)
                                       for side in ("training", "rollout")}
            if steps and "stale/turn_wait_seconds_training" in steps[0] else None,
            # (step, accuracy, seconds since the first evaluation started)
            "accuracy": [(s, a, round(t - t_eval[0], 1)) for (s, a), t in zip(r["heldout_accuracy_history"], t_eval)]}


def accuracy_at(curve: list, seconds: float) -> float:
    """A run's held-out accuracy at `seconds`: its last evaluation by then."""
    return [a for _, a, t in curve if t <= seconds][-1]


def equal_time(sync_runs: list[dict], runs: list[dict]) -> dict:
    """The asynchronous runs' held-out accuracy against the synchronous runs' of the same round at the same
    wall-clock time (the synchronous run's last evaluation by then): at every evaluation after the first (the
    first is the same policy in both), and at each run's last."""
    diffs = [a - accuracy_at(sync["accuracy"], t) for sync, r in zip(sync_runs, runs) for _, a, t in r["accuracy"][1:]]
    last = [r["accuracy"][-1][1] - accuracy_at(sync["accuracy"], r["accuracy"][-1][2])
            for sync, r in zip(sync_runs, runs)]
    return {"evaluations": len(diffs), "mean_difference": round(statistics.mean(diffs), 4) if diffs else None,
            "higher": sum(d > 1e-9 for d in diffs), "equal": sum(abs(d) <= 1e-9 for d in diffs),
            "lower": sum(d < -1e-9 for d in diffs), "last_difference_runs": [round(d, 4) for d in last],
            "last_difference_mean": round(statistics.mean(last), 4) if last else None}


def svg(curves: dict[str, list], path: Path) -> None:
    """Held-out accuracy against seconds, one polyline per run (no plotting library needed)."""
    W, H, pad = 640, 360, 48
    t_max = max(t for c in curves.values() for _, _, t in c) or 1.0
    accs = [a for c in curves.values() for _, a, _ in c]
    a_lo, a_hi = min(accs) - 0.02, max(accs) + 0.02
    x = lambda t: pad + (W - 2 * pad) * t / t_max  # noqa: E731
    y = lambda a: H - pad - (H - 2 * pad) * (a - a_lo) / (a_hi - a_lo)  # noqa: E731
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<line x1="{pad}" y1="{H - pad}" x2="{W - pad}" y2="{H - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{H - pad}" stroke="black"/>',
             f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">seconds since the first evaluation</text>',
             f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">held-out accuracy</text>']
    for i in range(5):
        a, t = a_lo + (a_hi - a_lo) * i / 4, t_max * i / 4
        parts += [f'<text x="{pad - 6}" y="{y(a) + 4:.0f}" text-anchor="end">{a:.2f}</text>',
                  f'<text x="{x(t):.0f}" y="{H - pad + 16}" text-anchor="middle">{t:.0f}</text>']
    for i, (name, c) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        pts = " ".join(f"{x(t):.1f},{y(a):.1f}" for _, a, t in c)
        parts += [f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>',
                  f'<text x="{W - pad - 110}" y="{pad + 16 * i}" fill="{color}">{name}</text>']
    path.write_text("\n".join(parts + ["</svg>"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stale_sync", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/tiny_cpu_disaggregated.yaml")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="override the config's steps")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--partial", action="store_true",
                        help="also run each staleness above 0 with stale_sync.partial_rollout=true")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="a round per seed (seed=S in every run of the round), instead of --rounds")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="overrides for every run (e.g. rollout.sleep_level=1)")
    args = parser.parse_args(argv)
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: every figure is relative to the synchronous loop")
    if args.seeds is not None and (len(set(args.seeds)) != len(args.seeds) or args.rounds != 1):
        parser.error("--seeds takes distinct seeds, one round each (leave out --rounds)")
    seeds = args.seeds or [None] * args.rounds
    os.chdir(REPO)
    from benchmarks.configs import prepare
    from rlhf.config import load_run_config

    config = Path(args.config)
    prepare(load_run_config(config, [*args.set, f"stale_sync.max_staleness={max(args.staleness)}"]))
    keep_previous(OUT)
    variants = [(str(k), k, False) for k in args.staleness]  # (label, staleness, partial rollouts)
    variants += [(f"{k}+partial", k, True) for k in args.staleness if k and args.partial]
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
    for i, seed in enumerate(seeds):
        extra = (*args.set, *([f"seed={seed}"] if seed is not None else []))
        for label, k, partial in variants:
            print(f"stale_sync: round {i + 1}{f' (seed {seed})' if seed is not None else ''}, staleness {label} ...",
                  file=sys.stderr, flush=True)
            r = run_once(config, k, OUT / f"s{label.replace('+', '_')}_r{i + 1}", args.steps, args.eval_every, partial,
                         extra)
            r["seed"] = seed
            print(f"stale_sync: {json.dumps(r)}", file=sys.stderr, flush=True)
            if "failed" in r:
                print(json.dumps({"failed": r}))
                return 1
            runs[label].append(r)
    tps = {k: statistics.median(r["tokens_per_second"] for r in rs) for k, rs in runs.items()}
    summary = {}
    for k, rs in runs.items():
        summary[k] = {"tokens_per_second": tps[k], "speedup_over_staleness_0": round(tps[k] / tps["0"], 2),
                      "tokens_per_second_runs": [r["tokens_per_second"] for r in rs],
                      "seconds_per_step_runs": [r["seconds_per_step"] for r in rs],
                      "staleness_max": max(r["staleness_max"] for r in rs),
                      "samples_dropped": sum(r["samples_dropped"] for r in rs),
                      "final_accuracy_runs": [r["accuracy"][-1][1] for r in rs]}
        if k != "0":  # at each of its evaluations: this run's accuracy and the synchronous run's by the same time
            summary[k]["accuracy_vs_sync_at_equal_time"] = [
                (t, a, accuracy_at(runs["0"][i]["accuracy"], t)) for i, r in enumerate(rs) for _, a, t in r["accuracy"]]
            summary[k]["equal_time"] = equal_time(runs["0"], rs)
    svg({f"staleness {k} (round {i + 1})": r["accuracy"] for k, rs in runs.items() for i, r in enumerate(rs)},
        OUT / "accuracy_vs_time.svg")
    print(json.dumps({"config": str(config), "overrides": args.set, "rounds": len(seeds), "seeds": args.seeds,
                      "summary": summary,
                      "runs": {k: rs for k, rs in runs.items()}, "plot": str(OUT / "accuracy_vs_time.svg")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
