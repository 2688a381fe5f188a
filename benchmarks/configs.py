"""Every shipped run config, as shipped: `rlhf train` on each, one after another, on this machine.

    python -m benchmarks.configs                                  # every run config under configs/
    python -m benchmarks.configs --only tiny_cpu_disaggregated    # one of them
    python -m benchmarks.configs --steps 10                       # a steps override (printed in the result)

A run config is a YAML file directly under `configs/`. Each runs in its own process (`python -m
rlhf.cli train CONFIG [steps=N]`, its own embedded Ray), with what it needs built first by our own code:
the `make-tiny` policy for the tiny configs, the random small policy for `small_cpu.yaml`
(`benchmarks.e2e_bench.build_policy`). Configs for devices this machine does not have (npu, cuda) are
listed as skipped, with the command that shows their plan instead. A config's previous outputs (its
`output_dir`, checkpoints included) are kept as `<output_dir>.<time>` and each run starts afresh.

Per config: held-out accuracy at the start and the end (and its gain in points), steps, seconds for the
run, seconds per step (the mean of `time/step`), and the trainer/engine logprob parity (largest
max-abs and mean-abs difference over the steps). The last line is one JSON object.
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


def run_configs() -> list[Path]:
    return sorted(p for p in (REPO / "configs").glob("*.yaml"))


def prepare(cfg) -> None:
    """Build what the config's model path needs, with our own code (nothing is downloaded)."""
    model_dir = Path(cfg.model.path)
    if (model_dir / "config.json").is_file():
        return
    if cfg.model.name in ("qwen3_moe_tiny", "pangu_moe_tiny"):
        from rlhf.tiny import make_tiny_args

        task = make_tiny_args(cfg).replace(f"--model {cfg.model.name}", "").split()  # --task code, --task tool
        subprocess.run([sys.executable, "-m", "rlhf.cli", "make-tiny", str(model_dir), "--model", cfg.model.name, *task],
                       check=True)
    else:
        from benchmarks.e2e_bench import build_policy

        build_policy(cfg)


def measure(path: Path, steps: int | None) -> dict:
    from rlhf.config import load_run_config
    from rlhf.schema import DeviceType

    overrides = [f"steps={steps}"] if steps else []
    cfg = load_run_config(path, overrides)
    if cfg.placement.device_type is not DeviceType.cpu:
        return {"skipped": f"placement.device_type {cfg.placement.device_type.value}: this machine has cpu only; "
                           f"`rlhf plan {path.relative_to(REPO)}` shows its layout and sync plan"}
    prepare(cfg)
    out_dir = Path(cfg.output_dir)
    keep_previous(out_dir)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlhf.cli", "train", str(path), *overrides],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seconds = time.time() - t0
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-5:]
        return {"failed": proc.returncode, "stderr_tail": tail, "seconds": round(seconds, 1)}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps_file = out_dir / "steps.jsonl"
    step_s = [json.loads(line)["time/step"] for line in steps_file.read_text().splitlines()]
    start, end = result["heldout_accuracy_start"], result["heldout_accuracy_end"]
    return {"steps": result["steps_run"], "heldout_accuracy_start": start, "heldout_accuracy_end": end,
            "gain_points": round(100 * (end - start), 1), "heldout_accuracy_history": result["heldout_accuracy_history"],
            "seconds": round(seconds, 1), "seconds_per_step": round(statistics.mean(step_s), 3),
            "parity_max_abs_diff": result["parity_max_abs_diff"],
            "parity_mean_abs_diff_max": result["parity_mean_abs_diff_max"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.configs", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", default=[], help="a config's name (file stem); repeatable")
    parser.add_argument("--steps", type=int, default=None, help="override every config's steps")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # the configs' relative paths (model, data, outputs) are the repository's
    paths = [p for p in run_configs() if not args.only or p.stem in args.only]
    unknown = set(args.only) - {p.stem for p in run_configs()}
    if unknown:
        parser.error(f"no run config named {sorted(unknown)} under configs/ (have {[p.stem for p in run_configs()]})")
    out = {}
    for path in paths:
        print(f"configs: {path.name} ...", file=sys.stderr, flush=True)
        out[path.stem] = measure(path, args.steps)
        print(f"configs: {path.name}: {json.dumps(out[path.stem])}", file=sys.stderr, flush=True)
    print(json.dumps({"steps_override": args.steps, "configs": out}))
    return 0 if all("failed" not in r for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
