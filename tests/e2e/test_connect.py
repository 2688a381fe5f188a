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


CALLER = r"""
import os, ray
try:
    ray.init(address=os.environ["GCS"], log_to_driver=False)
    print("JOINED")
except Exception as e:
    print("REFUSED", type(e).__name__, str(e).replace("\n", " ")[:400])
"""


def test_the_embedded_instance_refuses_callers_without_its_token_and_keeps_the_token_private():
    """Ray 2.60's servers listen on every interface, so the embedded instance's protection is Ray's token auth:
    a process that presents another token is refused, one with the token joins, and the token file (written
    with the default umask by Ray) is readable by its owner alone."""
    tmp = Path(tempfile.mkdtemp(prefix="rlhf-auth-", dir="/tmp"))
    try:
        home = tmp / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_TMPDIR=str(tmp), RAY_USAGE_STATS_ENABLED="0", HOME=str(home))
        script = CONNECT.replace("ray.shutdown()", "print(json.dumps({'gcs': ray.get_runtime_context().gcs_address}))\n"
                                 "import sys; sys.stdout.flush(); sys.stdin.read()\nray.shutdown()")
        owner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = ""
            while '"gcs"' not in line:
                line = owner.stdout.readline()
                assert line, owner.stderr.read()[-3000:]
            gcs = json.loads(line)["gcs"]
            token = home / ".ray" / "auth_token"
            assert token.exists() and token.stat().st_mode & 0o777 == 0o600
            verdicts = []
            # a refused caller retries for Ray's connect window (20 s) before it gives up; 2 s say the same
            budget = {"RAY_gcs_server_port_wait_time_s": "2"}
            for extra in ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, {"RAY_AUTH_MODE": "token"}):
                r = subprocess.run([sys.executable, "-c", CALLER], cwd=REPO, env={**env, "GCS": gcs, **budget, **extra},
                                   capture_output=True, text=True, timeout=120)
                verdicts.append(r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-2000:])
            assert verdicts[0].startswith("REFUSED") and verdicts[1] == "JOINED", verdicts
        finally:
            owner.communicate(input="", timeout=120)
        assert owner.returncode == 0, owner.stderr[-3000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
