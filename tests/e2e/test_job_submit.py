"""`ray job submit` as a launch path (docs/launch.md): a local cluster from `ray start --head`, a tiny run
submitted as a job with `--working-dir .`, exactly as on a real cluster.

What this guards:
- the job runs from the uploaded copy of the repository (no out/, no .venv): model, data and outputs
  are reached by absolute path, and `rlhf` is found on the PATH that `ray start` saw;
- the upload stays small because of `.rayignore` alone (the submit ignores .gitignore here);
- token auth: a local `ray.init()` earlier on the machine leaves ~/.ray/auth_token, which makes a plain
  `ray start` enable token auth and `ray job submit` fail with "Missing authentication token".
  RAY_AUTH_MODE=disabled on both sides is the recipe for a loopback-only cluster;
- the job SUCCEEDED, its logs end with the run's JSON line, the W&B offline run and the trace exist.

The cluster is isolated from any other Ray on the machine: its own --temp-dir (so no
/tmp/ray/ray_current_cluster that a plain `ray.init()` elsewhere would join), free ports for everything
that has a fixed default, the dashboard on 127.0.0.1. It is stopped by killing its own processes
(found by temp dir and GCS port, plus their descendants): `ray stop` would kill every Ray process of the
machine, including another test session's embedded Ray.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's bin: `ray`, `rlhf`, `python`
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 480  # measured about 2-3.5 minutes on 2 shared cores, most of it vLLM start-up
CLI_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    """The environment of every `ray` command: no inherited RAY_* (an in-process `ray.init()` of this
    pytest session sets RAY_AUTH_MODE=token, RAY_ADDRESS would redirect the CLI), auth off on both
    sides, the venv first on PATH (the job's entrypoint is resolved on the PATH `ray start` saw)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


@dataclass
class Cluster:
    address: str  # the dashboard, what `ray job` talks to
    gcs_port: int
    temp_dir: Path

    def ray(self, *args: str, timeout: float = CLI_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "ray"), *args], cwd=REPO, env=_env(**env), capture_output=True,
                              text=True, timeout=timeout)

    def job(self, *args: str, timeout: float = CLI_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
        return self.ray("job", args[0], "--address", self.address, *args[1:], timeout=timeout, **env)


def _stop(temp_dir: Path, gcs_port: int, grace_s: float = 10.0) -> int:
    """Stop this cluster only: SIGTERM its processes (command line names its temp dir or GCS port) and
    all their descendants (workers, the job's driver, vLLM engine processes), SIGKILL what is left."""
    import psutil

    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    pattern = re.compile(rf"{re.escape(str(temp_dir))}|:{gcs_port}\b")
    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid in me or not pattern.search(" ".join(p.info["cmdline"] or [])):
                continue
            for q in (p, *p.children(recursive=True)):
                procs.setdefault(q.pid, q)
        except psutil.Error:
            continue
    procs = {pid: p for pid, p in procs.items() if pid not in me}
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return len(procs)


@pytest.fixture
def ray_cluster():
    # Short path: Ray's unix sockets live under it (107-character limit; pytest's tmp_path can be longer).
    temp_dir = Path(tempfile.mkdtemp(prefix="rlhf-rayjob-", dir="/tmp"))
    gcs, dashboard = _free_port(), _free_port()
    cluster = Cluster(f"http://127.0.0.1:{dashboard}", gcs, temp_dir)
    # the cluster's processes keep their temp files (multiprocessing's pymp-* dirs among them: the stop below
    # kills, so their exit handlers never remove them) under the cluster's dir, removed with it
    tmp = temp_dir / "tmp"
    tmp.mkdir()
    try:
        t0 = time.monotonic()
        r = cluster.ray("start", "--head", "--port", str(gcs),
                        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
                        "--ray-client-server-port", str(_free_port()),
                        "--dashboard-agent-listen-port", str(_free_port()),
                        "--resources", json.dumps({"rlhf_device": 2}), "--num-cpus", "2",
                        "--temp-dir", str(temp_dir), "--disable-usage-stats", timeout=START_TIMEOUT_S, TMPDIR=str(tmp))
        assert r.returncode == 0, f"ray start failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        print(f"ray start: {time.monotonic() - t0:.1f} s", file=sys.stderr)
        yield cluster
    finally:
        t0 = time.monotonic()
        n = _stop(temp_dir, gcs)
        print(f"cluster stopped ({n} processes): {time.monotonic() - t0:.1f} s", file=sys.stderr)
        shutil.rmtree(temp_dir, ignore_errors=True)


# The limit covers the fixtures: make-tiny takes about 90 s on a quiet machine but 10-13 minutes when other
# processes share the 2 cores (measured); then ray start, the job (bounded by JOB_TIMEOUT_S) and the stop.
@pytest.mark.timeout(1200)
def test_ray_job_submit_runs_a_tiny_run(tiny, ray_cluster, tmp_path):
    d, _ = tiny
    out = tmp_path / "run"
    job_id = f"rlhf-test-{uuid.uuid4().hex[:8]}"
    overrides = [f"model.path={d}", f"data.train_files=[{d / 'train.jsonl'}]",
                 f"data.heldout_files=[{d / 'heldout.jsonl'}]", f"output_dir={out}", f"tracking.dir={out}",
                 f"checkpoint.dir={out / 'ckpt'}", "steps=2", "eval_every=2", "checkpoint.export_hf=false",
                 "trainer.zero_stage=3"]  # the job also runs the row-sharded trainer through the whole loop
    t0 = time.monotonic()
    try:
        # blocks until the job ends and exits non-zero when it failed; .gitignore is not read, so the
        # upload is bounded by .rayignore alone
        submit = ray_cluster.job("submit", "--submission-id", job_id, "--working-dir", ".", "--",
                                 "rlhf", "train", "configs/tiny_cpu.yaml", *overrides,
                                 timeout=JOB_TIMEOUT_S, RAY_RUNTIME_ENV_IGNORE_GITIGNORE="1")
    except subprocess.TimeoutExpired:
        ray_cluster.job("stop", job_id)
        logs = ray_cluster.job("logs", job_id).stdout
        pytest.fail(f"the job did not end within {JOB_TIMEOUT_S} s; its log:\n{logs[-4000:]}")
    print(f"ray job submit (blocking): {time.monotonic() - t0:.1f} s", file=sys.stderr)

    st = ray_cluster.job("status", job_id)
    status = st.stdout + st.stderr  # "Job '<id>' succeeded" for SUCCEEDED
    logs = ray_cluster.job("logs", job_id).stdout
    assert f"Job '{job_id}' succeeded" in status and submit.returncode == 0, \
        f"job status: {status}\nsubmit stderr:\n{submit.stderr[-2000:]}\njob log:\n{logs[-4000:]}"

    # the job ran from the uploaded copy, which left out everything big
    unpacked = ray_cluster.temp_dir / "session_latest" / "runtime_resources" / "working_dir_files"
    pkgs = [p for p in unpacked.glob("_ray_pkg_*") if p.is_dir()]
    assert len(pkgs) == 1, f"expected one unpacked working dir under {unpacked}, found {pkgs}"
    pkg = pkgs[0]
    assert (pkg / "rlhf" / "driver" / "loop.py").is_file() and (pkg / "configs" / "tiny_cpu.yaml").is_file()
    assert not any((pkg / name).exists() for name in (".git", ".venv", "out", "wandb"))
    size = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
    assert size < 20 * 2**20, f"the working dir upload is {size / 2**20:.1f} MiB; extend .rayignore"

    result = json.loads(logs.strip().splitlines()[-1])  # the run's one JSON line ends the job's log
    assert result["steps"] == 2 and result["steps_run"] == 2 and result["syncs"] == 2
    assert result["parity_mean_abs_diff_max"] < 1e-5  # engine logprobs match the zero_stage=3 trainer's
    wandb_dir = Path(result["wandb_dir"])
    assert wandb_dir.parent == out / "wandb" and wandb_dir.name.startswith("offline-run-")
    assert list(wandb_dir.glob("run-*.wandb"))
    assert Path(result["trace"]) == out / "trace.json"
    events = json.loads(Path(result["trace"]).read_text())["traceEvents"]
    assert {"rollout", "update", "weight sync"} <= {e["name"] for e in events if e["ph"] == "X"}
    assert json.loads((out / "result.json").read_text())["steps_run"] == 2
