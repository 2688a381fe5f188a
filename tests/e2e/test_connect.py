"""`rlhf train` without RAY_ADDRESS starts its own embedded Ray, whatever another cluster left behind."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

CONNECT = r"""
import json, ray
from actors.roles import connect
from rlhf.config import load_run_config
cfg = load_run_config("configs/tiny_cpu.yaml")
owned = connect(cfg.placement, log=lambda *_: None)
res = ray.cluster_resources()
print(json.dumps({"owned": owned, "devices": res.get(cfg.placement.device_resource, 0)}))
ray.shutdown()
"""


def test_a_stale_cluster_address_does_not_capture_the_embedded_start():
    # `ray start` and ray.cluster_utils write ray_current_cluster under Ray's temp dir and leave it when the
    # cluster is gone; a plain ray.init() then tries to join that cluster ("When connecting to an existing
    # cluster, num_cpus and num_gpus must not be provided"). Our own temp dir (short: Ray's socket paths).
    tmp = Path(tempfile.mkdtemp(prefix="rlhf-conn-", dir="/tmp"))
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing listens there
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0")
        r = subprocess.run([sys.executable, "-c", CONNECT], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["owned"] is True and out["devices"] >= 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
