"""Chaos: the tiny job with faults injected at random (seeded) moments, against the same run undisturbed.

    python -m benchmarks.chaos --seed 0 --faults 4                 # configs/tiny_cpu.yaml, 40 steps
    python -m benchmarks.chaos --seed 1 --faults 6 --steps 60 --kinds engine trainer driver

Faults, drawn with `--seed`, each at its own step after the first checkpoint (a trainer rank lost before any
checkpoint stops the run by design, docs/faults.md):
  engine   a rollout engine killed during generation, weight sync or evaluation (`chaos.kill_engines`)
  hang     a rollout engine stopped (SIGSTOP: alive, never answering) during generation, weight sync or
           evaluation (`chaos.stop_engines`), found hung by its liveness probes and replaced
  trainer  a trainer rank killed during the update, the old-logprob pass or the weight sync
           (`chaos.kill_trainer_ranks`): every trainer and reference rank restarts from the last checkpoint
  driver   the `rlhf train` process killed with SIGKILL a random fraction into the step, then the run started
           again with `checkpoint.resume=auto` (what an operator or a job supervisor does)

Both runs are `rlhf train CONFIG` processes with the same seed, checkpoints every `--checkpoint-every` steps
(so trainer and driver faults have one to go back to), outputs under `out/chaos_bench/` (a previous
benchmark's kept beside it). Reported: faults injected and survived (the run reached its last step), steps
redone, samples lost (groups the disturbed run trained on fewer than the undisturbed one, times the group
size, over every step), how many steps' metrics equal the undisturbed run's (timings aside), held-out
accuracy at the end of both, and the seconds each took. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.outputs import keep_previous

REPO = Path(__file__).resolve().parents[1]
OUT = Path("out/chaos_bench")
TIMING = ("time/", "throughput/", "sync/seconds", "sync/gb_per_s", "sync/floor", "sync/link", "onload/", "offload/",
          "faults/")
ENGINE_PHASES, TRAINER_PHASES = ("generate", "sync", "evaluate"), ("update", "logprobs", "sync")


def draw_faults(seed: int, n: int, steps: int, kinds: list[str], engines: int, trainer_ranks: int,
                eval_every: int, first_step: int) -> list[dict]:
    """`n` faults at distinct steps in first_step..steps (an engine killed during evaluation only where one runs)."""
    rng = random.Random(seed)
    if n > steps - first_step + 1:
        raise SystemExit(f"--faults {n}: at most one fault per step from step {first_step}, so at most "
                         f"{steps - first_step + 1}")
    faults = []
    for step in sorted(rng.sample(range(first_step, steps + 1), n)):
        kind = rng.choice(kinds)
        if kind in ("engine", "hang"):
            phases = [p for p in ENGINE_PHASES if p != "evaluate" or step % eval_every == 0 or step == steps]
            faults.append({"kind": kind, "step": step, "index": rng.randrange(engines), "phase": rng.choice(phases)})
        elif kind == "trainer":
            faults.append({"kind": kind, "step": step, "index": rng.randrange(trainer_ranks),
                           "phase": rng.choice(TRAINER_PHASES)})
        else:
            faults.append({"kind": kind, "step": step, "fraction": round(rng.random(), 3)})
    return faults


def overrides(out: Path, steps: int, eval_every: int, ckpt_every: int, extra: list[str]) -> list[str]:
    return [f"steps={steps}", f"eval_every={eval_every}", f"output_dir={out}", f"tracking.dir={out}",
            f"checkpoint.dir={out / 'ckpt'}", f"checkpoint.every_steps={ckpt_every}", "checkpoint.export_hf=false",
            *extra]


def chaos_overrides(faults: list[dict], after_step: int) -> list[str]:
    engines = [f"{f['index']}@{f['step']}:{f['phase']}" for f in faults if f["kind"] == "engine" and f["step"] > after_step]
    trainer = [f"{f['index']}@{f['step']}:{f['phase']}" for f in faults if f["kind"] == "trainer" and f["step"] > after_step]
    stops = [f"{f['index']}@{f['step']}:{f['phase']}" for f in faults if f["kind"] == "hang" and f["step"] > after_step]
    return ([f"chaos.kill_engines=[{','.join(engines)}]"] if engines else []) + \
           ([f"chaos.stop_engines=[{','.join(stops)}]"] if stops else []) + \
           ([f"chaos.kill_trainer_ranks=[{','.join(trainer)}]"] if trainer else [])


def steps_done(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_train(config: Path, args: list[str], log: Path, kill_at: dict | None = None,
              step_seconds: float = 2.0) -> tuple[int, dict | None, int | None]:
    """One `rlhf train` process: (return code, its result, the step it was killed during, if it was)."""
    with log.open("a") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf.cli", "train", str(config), *args], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=f, text=True)
    killed = None
    if kill_at is not None:
        out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("output_dir=")))
        while proc.poll() is None:  # the fault's step starts once the step before it is recorded
            done = steps_done(out)
            if done and done[-1]["step"] >= kill_at["step"] - 1:
                time.sleep(kill_at["fraction"] * step_seconds)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    killed = kill_at["step"]
                break
            time.sleep(0.05)
    stdout, _ = proc.communicate()
    result = json.loads(stdout.strip().splitlines()[-1]) if proc.returncode == 0 and stdout.strip() else None
    return proc.returncode, result, killed


def disturbed(config: Path, out: Path, base: list[str], faults: list[dict], step_seconds: float) -> dict:
    """The run with its faults; driver faults kill the process, and it is resumed as an operator would."""
    pending_driver = [f for f in faults if f["kind"] == "driver"]
    log, after, restarts, redone_by_resume, t0 = out / "driver.log", 0, 0, 0, time.time()
    while True:
        kill_at = pending_driver[0] if pending_driver else None
        args = base + chaos_overrides(faults, after) + (["checkpoint.resume=auto"] if restarts else [])
        rc, result, killed = run_train(config, args, log, kill_at, step_seconds)
        if killed is not None:
            pending_driver.pop(0)
            done = max((m["step"] for m in steps_done(out)), default=0)
            ckpts = sorted(int(p.name.split("_")[1]) for p in (out / "ckpt").glob("step_*") if (p / "COMPLETE").exists())
            resumed_from = ckpts[-1] if ckpts else 0
            redone_by_resume += max(0, done - resumed_from)
            after, restarts = killed, restarts + 1
            continue
        return {"rc": rc, "result": result, "driver_restarts": restarts, "steps_redone_by_resume": redone_by_resume,
                "seconds": round(time.time() - t0, 1),
                "stderr_tail": log.read_text(errors="replace").strip().splitlines()[-5:] if rc else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs/tiny_cpu.yaml")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=["engine", "trainer", "driver"],
                    choices=["engine", "hang", "trainer", "driver"])
    a = ap.parse_args()

    sys.path.insert(0, str(REPO))
    from rlhf.config import load_run_config

    cfg = load_run_config(a.config)
    trainer_ranks = cfg.trainer.pp * cfg.trainer.dp * cfg.trainer.tp
    faults = draw_faults(a.seed, a.faults, a.steps, a.kinds, cfg.rollout.num_engines, trainer_ranks, a.eval_every,
                         a.checkpoint_every + 1)
    keep_previous(OUT)
    OUT.mkdir(parents=True)
    print(f"chaos: {len(faults)} fault(s): {faults}", file=sys.stderr)

    calm_out = (OUT / "undisturbed").resolve()
    t0 = time.time()
    rc, calm, _ = run_train(a.config, overrides(calm_out, a.steps, a.eval_every, a.checkpoint_every, []),
                            calm_out.parent / "undisturbed.log")
    if rc != 0:
        raise SystemExit(f"the undisturbed run failed (rc {rc}): see {calm_out.parent / 'undisturbed.log'}")
    calm_seconds = round(time.time() - t0, 1)
    calm_steps = {m["step"]: m for m in steps_done(calm_out)}

    out = (OUT / "disturbed").resolve()
    out.mkdir(parents=True)
    d = disturbed(a.config, out, overrides(out, a.steps, a.eval_every, a.checkpoint_every, []), faults,
                  calm["seconds_per_step"] or 2.0)
    got = {m["step"]: m for m in steps_done(out)}  # a redone step: the later line counts
    G = cfg.algorithm.group_size
    lost = sum(max(0, m["rollout/groups_kept"] - got.get(s, {}).get("rollout/groups_kept", 0)) * G
               for s, m in calm_steps.items())
    equal = sum(1 for s, m in calm_steps.items() if s in got and all(
        k.startswith(TIMING) or got[s].get(k) == v for k, v in m.items()))
    r = d["result"] or {}
    said = (out / "driver.log").read_text(errors="replace")  # every process's log: a killed driver's result is lost
    survived = len(faults) if d["rc"] == 0 and r.get("steps_run") is not None and max(got, default=0) == a.steps else 0
    summary = {
        "seed": a.seed, "faults_injected": len(faults), "faults_survived": survived,
        "faults": faults,
        "engine_restarts": sum(len(k.split(",")) for k in re.findall(r"engine\(s\) \[([\d, ]+)\] replaced and serving",
                                                                      said)),
        "trainer_restarts": said.count(": trainer restarted ("), "driver_restarts": d["driver_restarts"],
        "steps_redone": sum(max(0, int(b) - int(a) + 1) for a, b in re.findall(r"steps (\d+)\.\.(\d+) are redone", said))
                        + d["steps_redone_by_resume"],
        "samples_lost": lost, "steps": a.steps, "steps_equal_to_undisturbed": equal,
        "heldout_accuracy_end": r.get("heldout_accuracy_end"),
        "heldout_accuracy_end_undisturbed": calm["heldout_accuracy_end"],
        "seconds": d["seconds"], "seconds_undisturbed": calm_seconds,
        "failed": d["stderr_tail"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
