#!/usr/bin/env bash
# The main job (README: `make run`): GRPO on the tiny addition task from the `rlhf make-tiny` policy,
# co-located on an embedded local Ray (configs/tiny_cpu.yaml). Builds the tiny policy once. Extra
# arguments are key=value overrides, e.g. `make run ARGS="steps=5"`.
set -euo pipefail
cd "$(dirname "$0")/.."
RLHF=.venv/bin/rlhf
[ -f out/tiny/tiny.json ] || "$RLHF" make-tiny out/tiny
exec "$RLHF" train configs/tiny_cpu.yaml "$@"
