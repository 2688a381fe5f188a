"""How well `rlhf simulate` predicts this machine: real runs that differ in layout, placement, model (tiny,
small), batch and length, each measured by benchmarks/e2e_bench.py; the simulator's calibration fitted on
some of them, its predictions scored on the others (held out).

    .venv/bin/rlhf calibrate --out configs/hardware/cpu_2core.yaml      # the machine's raw figures
    .venv/bin/python -m benchmarks.sim_accuracy --repeats 3 --write-calibration   # runs, fit, score, write

Each run's measurement is kept in out/sim_accuracy/<name>.json and reused (`--rerun` measures again);
`--repeats N` measures every run N times (interleaved; repeats kept as <name>.r<i>.json) and fits and scores
each phase's median. The
policies have random weights (our code writes them), so completions run to the limit unless they stop on
EOS; the simulator is given each run's measured mean prompt and completion lengths (the workload, not the
timing). The last line is one JSON object: `step_mape_heldout` (mean absolute percentage error of the step
on held-out runs), `spearman_heldout` and `spearman_all` (rank correlation of predicted and measured step
times), per-phase errors and every run's prediction and measurement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "out" / "sim_accuracy"
TINY = ["model.path=out/sim_accuracy/tiny", "data.train_files=[out/sim_accuracy/tiny/train.jsonl]",
        "data.heldout_files=[out/sim_accuracy/tiny/heldout.jsonl]", "algorithm.dynamic_sampling=false",
        "data.gen_prompts_per_step=0", "tracking.trace=false"]
# fp32 and synchronous, as the small runs of docs/simulate.md were measured (small_cpu.yaml ships bf16, staleness 1)
SMALL = ["tracking.trace=false", "trainer.compute_dtype=float32", "rollout.dtype=float32", "stale_sync.max_staleness=0",
         "algorithm.tis_cap=0", "rollout.num_engines=2", "rollout.sleep_level=2", "placement.rollout.devices=0-1"]
ONE_DEVICE = ["placement.trainer.devices=0", "placement.reference.devices=0", "placement.rollout.devices=0"]


@dataclass(frozen=True)
class Run:
    name: str
    config: str
    overrides: tuple
    warmup: int
    steps: int
    heldout: bool


# The calibration runs span what the fit must separate: one and two trainer ranks and engines, short and long
# completions, on- and off-policy updates, the tiny and the small model; the held-out runs combine these
# differently (TP trainer, TP engine, disaggregated pools, other batch and length, the small model shorter and
# on one device).
RUNS = (
    Run("tiny_default", "configs/tiny_cpu.yaml", (*TINY,), 3, 8, False),
    Run("tiny_long", "configs/tiny_cpu.yaml", (*TINY, "rollout.max_new_tokens=32", "data.prompts_per_step=16"),
        2, 6, False),
    Run("tiny_on_policy", "configs/tiny_cpu.yaml", (*TINY, "trainer.mini_batch_size=512"), 3, 8, False),
    Run("tiny_trainer_tp2", "configs/tiny_cpu.yaml", (*TINY, "trainer.tp=2", "trainer.dp=1", "trainer.ep=1"),
        3, 8, True),
    Run("small_default", "configs/small_cpu.yaml", (*SMALL,), 1, 2, False),
    Run("tiny_one_device", "configs/tiny_cpu.yaml", (*TINY, "trainer.dp=1", "trainer.ep=1", "rollout.num_engines=1",
                                                     *ONE_DEVICE), 3, 8, False),
    Run("tiny_disaggregated", "configs/tiny_cpu_disaggregated.yaml", (*TINY,), 3, 8, True),
    Run("tiny_engine_tp2", "configs/tiny_cpu.yaml", (*TINY, "rollout.tp=2", "rollout.num_engines=1"), 3, 8, True),
    Run("tiny_mid", "configs/tiny_cpu.yaml", (*TINY, "rollout.max_new_tokens=16", "data.prompts_per_step=24",
                                              "algorithm.group_size=8", "trainer.mini_batch_size=64"), 3, 8, True),
    Run("small_short", "configs/small_cpu.yaml", (*SMALL, "rollout.max_new_tokens=64", "data.prompts_per_step=4",
                                                  "trainer.mini_batch_size=32"),
        1, 2, True),
    Run("small_one_device", "configs/small_cpu.yaml", (*SMALL, "rollout.max_new_tokens=64", "trainer.dp=1",
                                                       "trainer.ep=1", "rollout.num_engines=1", *ONE_DEVICE),
        1, 2, True),
)

# measured phase (the run's time/* metrics) -> the simulator's phase
MEASURED = {"reward": ("reward",), "logprobs": ("old_logprobs",), "reference": ("reference_logprobs",),
            "update": ("update",), "sync": ("weight_sync",), "offload": ("switch_to_training", "switch_to_rollout")}


def measure(run: Run, rerun: bool, repeat: int = 0) -> dict:
    path = OUT / (f"{run.name}.json" if not repeat else f"{run.name}.r{repeat}.json")
    if path.is_file() and not rerun:
        return json.loads(path.read_text())
    overrides = [*run.overrides, f"output_dir=out/sim_accuracy/runs/{run.name}",
                 f"checkpoint.dir=out/sim_accuracy/runs/{run.name}/checkpoints",
                 f"tracking.dir=out/sim_accuracy/runs/{run.name}"]
    cmd = [sys.executable, "-m", "benchmarks.e2e_bench", "--config", run.config, "--warmup", str(run.warmup),
           "--steps", str(run.steps), *overrides]
    print(f"{run.name}{f' (repeat {repeat})' if repeat else ''}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{run.name} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["prompt_tokens"] = prompt_tokens(run)
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def median_of(measurements: list[dict]) -> dict:
    """One measurement from a run's repeats: each phase's median seconds (this machine is shared and noisy);
    the workload (tokens, lengths) is the same in every repeat, a seed's."""
    import statistics

    keys = set().union(*(m["phase_seconds"] for m in measurements))
    phases = {k: statistics.median(m["phase_seconds"].get(k, 0.0) for m in measurements) for k in keys}
    return measurements[0] | {"phase_seconds": phases, "repeats": len(measurements)}


def load(run: Run):
    from rlhf.config import load_run_config

    return load_run_config(REPO / run.config, list(run.overrides))


def prompt_tokens(run: Run) -> float:
    """Mean tokens of the run's training prompts, by its tokenizer."""
    from rlhf.data.prompts import load_prompts
    from rlhf.data.tokenizer import load_tokenizer

    cfg = load(run)
    tok = load_tokenizer(cfg.model.path)
    rows = load_prompts(cfg.data.train_files, cfg.data.prompt_key, cfg.data.answer_key).rows
    ids = [min(len(tok.encode(r.prompt).ids), cfg.data.max_prompt_tokens) for r in rows[:512]]
    return sum(ids) / len(ids)


def measured_phases(m: dict) -> dict:
    ph = m["phase_seconds"]
    out = {sim: sum(ph.get(k, 0.0) for k in keys) for sim, keys in MEASURED.items()}
    out["generate"] = ph.get("rollout", 0.0) - ph.get("reward", 0.0)
    # the run's last step also scores the held-out prompts and saves the final checkpoint: not a step's work
    out["step"] = ph["step"] - ph.get("evaluate", 0.0) - ph.get("checkpoint", 0.0)
    out["driver"] = max(0.0, out["step"] - sum(v for k, v in out.items() if k != "step"))
    return out


def predict(run: Run, m: dict, hw) -> dict:
    from rlhf.report import simulate

    cfg = load(run)
    samples = (cfg.data.gen_prompts_per_step or cfg.data.prompts_per_step) * cfg.algorithm.group_size
    response = m["generated_tokens_per_step"] / samples
    return simulate(cfg, hw, prompt_tokens=m["prompt_tokens"], response_tokens=response)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_accuracy", description=__doc__.split("\n")[0])
    parser.add_argument("--hardware", default=str(REPO / "configs" / "hardware" / "cpu_2core.yaml"))
    parser.add_argument("--rerun", action="store_true", help="measure every run again")
    parser.add_argument("--only", nargs="*", help="measure only these runs (names)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="measurements of each run (kept apart, reused like the first); the fit and the scores "
                             "take each phase's median")
    parser.add_argument("--write-calibration", action="store_true",
                        help="write the fitted calibration into the hardware file")
    args = parser.parse_args(argv)

    import yaml

    from rlhf.sim.fit import fit_phase, mape, spearman
    from rlhf.sim.hardware import PHASES, hardware_to_dict, load_hardware

    runs = [r for r in RUNS if not args.only or r.name in args.only]
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    # repeats interleaved (every run once, then again) so a slow spell of the machine is spread over the runs
    by_repeat = [{r.name: measure(r, args.rerun, i) for r in runs} for i in range(args.repeats)]
    measured = {r.name: median_of([rep[r.name] for rep in by_repeat]) for r in runs}
    raw = replace(load_hardware(args.hardware), calibration={})
    # fit: each phase's (modelled, events) from the uncalibrated model against the calibration runs' seconds
    calib_runs = [r for r in runs if not r.heldout]
    parts = {r.name: predict(r, measured[r.name], raw)["phases"] for r in runs}
    calibration = {}
    for phase in PHASES:
        rows = [(parts[r.name][phase].modelled, parts[r.name][phase].events, parts[r.name][phase].calls,
                 measured_phases(measured[r.name])[phase]) for r in calib_runs]
        if any(y > 0 for *_, y in rows):
            calibration[phase] = fit_phase(rows)
    hw = replace(raw, calibration=calibration)
    rows = []
    for r in runs:
        pred = predict(r, measured[r.name], hw)
        meas = measured_phases(measured[r.name])
        rows.append({"run": r.name, "heldout": r.heldout, "measured_step": round(meas["step"], 3),
                     "predicted_step": round(pred["step_seconds"], 3),
                     "measured": {k: round(v, 3) for k, v in meas.items() if v},
                     "predicted": {k: round(v, 3) for k, v in pred["phases"].items() if v}})
    held = [x for x in rows if x["heldout"]]
    cal = [x for x in rows if not x["heldout"]]
    out = {"hardware": hw.name, "runs": len(rows), "calibration_runs": [x["run"] for x in cal],
           "heldout_runs": [x["run"] for x in held], "repeats": args.repeats,
           "step_mape_heldout": round(mape([x["predicted_step"] for x in held], [x["measured_step"] for x in held]), 1)
           if held else None,
           "step_mape_calibration": round(mape([x["predicted_step"] for x in cal], [x["measured_step"] for x in cal]), 1),
           "spearman_heldout": round(spearman([x["predicted_step"] for x in held], [x["measured_step"] for x in held]), 3)
           if len(held) > 1 else None,
           "spearman_all": round(spearman([x["predicted_step"] for x in rows], [x["measured_step"] for x in rows]), 3)
           if len(rows) > 1 else None,
           "phase_mape_heldout": {}, "calibration": {k: [round(c.scale, 4), round(c.fixed_s, 7), round(c.call_s, 5)]
                                                       for k, c in calibration.items()}, "per_run": rows}
    for phase in ("generate", "logprobs", "update", "sync"):
        pairs = [(x["predicted"].get(phase, 0.0), x["measured"].get(phase, 0.0)) for x in held
                 if x["measured"].get(phase, 0.0) > 0.05]
        if pairs:
            out["phase_mape_heldout"][phase] = round(mape(*zip(*pairs)), 1)
    print(f"{'run':<20} {'held out':>8} {'measured s':>11} {'predicted s':>12} {'error':>7}", file=sys.stderr)
    for x in rows:
        err = 100 * (x["predicted_step"] - x["measured_step"]) / x["measured_step"]
        print(f"{x['run']:<20} {str(x['heldout']):>8} {x['measured_step']:>11.3f} {x['predicted_step']:>12.3f} "
              f"{err:>6.1f}%", file=sys.stderr)
    if args.write_calibration:
        path = Path(args.hardware)
        head = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
        path.write_text(head + yaml.safe_dump(hardware_to_dict(hw), sort_keys=False))
        print(f"wrote the calibration into {path}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
