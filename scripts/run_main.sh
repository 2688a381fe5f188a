#!/usr/bin/env bash
# The main job (README: `make run`): GRPO on the tiny addition task from the `rlhf make-tiny` policy,
# asynchronously (StaleSync, staleness 1) on two pools of one core each, on an embedded local Ray
# (configs/tiny_cpu_async.yaml; why not the co-located synchronous configs/tiny_cpu.yaml: docs/stale_sync.md,
# "Is it the main job?"). Builds the tiny policy once. Extra arguments are
# key=value overrides, e.g. `make run ARGS="steps=5"`. A previous run's outputs (out/tiny_run_async:
# checkpoints, steps.jsonl, W&B run, HF export) are kept as out/tiny_run_async.<time>, so a new run starts
# afresh and nothing of the old one is overwritten.
set -euo pipefail
cd "$(dirname "$0")/.."
RLHF=.venv/bin/rlhf
CONFIG=configs/tiny_cpu_async.yaml
OUT=out/tiny_run_async  # the config's output_dir
[ -f out/tiny/tiny.json ] || "$RLHF" make-tiny out/tiny
if [ -d "$OUT" ] && [[ " $* " != *" output_dir="* && " $* " != *" checkpoint."* ]]; then
    kept="$OUT.$(date +%Y%m%d-%H%M%S)"
    mv "$OUT" "$kept"
    echo "run_main: the previous run's outputs are kept in $kept" >&2
fi
exec "$RLHF" train "$CONFIG" "$@"
