#!/usr/bin/env bash
# The main job (README: `make run`): GRPO on the tiny addition task from the `rlhf make-tiny` policy,
# co-located on an embedded local Ray (configs/tiny_cpu.yaml). Builds the tiny policy once. Extra
# arguments are key=value overrides, e.g. `make run ARGS="steps=5"`. A previous run's outputs
# (out/tiny_run: checkpoints, steps.jsonl, W&B run, HF export) are kept as out/tiny_run.<time>, so a new
# run starts afresh and nothing of the old one is overwritten.
set -euo pipefail
cd "$(dirname "$0")/.."
RLHF=.venv/bin/rlhf
[ -f out/tiny/tiny.json ] || "$RLHF" make-tiny out/tiny
if [ -d out/tiny_run ] && [[ " $* " != *" output_dir="* && " $* " != *" checkpoint."* ]]; then
    kept="out/tiny_run.$(date +%Y%m%d-%H%M%S)"
    mv out/tiny_run "$kept"
    echo "run_main: the previous run's outputs are kept in $kept" >&2
fi
exec "$RLHF" train configs/tiny_cpu.yaml "$@"
