"""Shared by the end-to-end tests: one tiny policy (`rlhf make-tiny`, about 70 s) and one embedded Ray
session (about 7 s) for the whole test session."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def rlhf(*args, timeout=900, cwd=REPO, env=None):
    """Run the `rlhf` command; its last stdout line is a JSON object."""
    r = subprocess.run([sys.executable, "-m", "rlhf.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, cwd=cwd, env=env)
    assert r.returncode == 0, f"rlhf {args[0]} failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def run_rlhf():
    return rlhf


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "policy"
    return d, rlhf("make-tiny", d)


@pytest.fixture(scope="session")
def ray_session():
    """Devices for every placement the tests use (4 stand-in cpu devices); a new instance whatever
    /tmp/ray/ray_current_cluster names (see actors.roles.connect)."""
    import ray
    ray.init(address="local", num_cpus=4, resources={"rlhf_device": 4}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
