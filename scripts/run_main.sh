#!/usr/bin/env bash
# The main job (README: `make run`). Builds the tiny policy once, then runs on configs/tiny_cpu.yaml.
# Until the RL loop lands (`rlhf train`), the largest real part is the policy's evaluation with our torch
# model and a vLLM engine: held-out accuracy, greedy agreement, one rollout batch with rewards.
set -euo pipefail
cd "$(dirname "$0")/.."
RLHF=.venv/bin/rlhf
[ -f out/tiny/tiny.json ] || "$RLHF" make-tiny out/tiny
exec "$RLHF" eval configs/tiny_cpu.yaml "$@"
