"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`, two stand-in devices each), the run joined
through RAY_ADDRESS as `ray job submit`'s driver does, against the one-node run of the same seed:

(a) disaggregated: the trainer on node 0, the engine and the reward worker on node 1, so the weight sync
    crosses nodes over the transport (gloo), never shared memory;
(b) co-located with one device per node: the trainer's two ranks on different nodes (data-parallel
    reductions and the expert all-to-all cross nodes, the latter in two hops: trainer.hierarchical_ep), each
    engine beside one of them.

Every metric that does not measure time or bandwidth equals the one-node run's, step by step, and the
held-out accuracy history is the same. What it guards: a change that assumes one host (shared memory
between ranks on different nodes, a path only the driver's machine has) fails here.

One cluster for both runs, in a helper process of its own (this session's embedded Ray stays apart).
Per node 3 logical CPUs: run (b) asks 2 CPUs per device, so its two single-device placement groups
cannot share a node and must spread; run (a)'s two-device groups are held apart by the devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rlhf.config import load_run_config
from rlhf.driver import train

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
STEPS = 3

CLUSTER = r"""
import json, os, sys
import ray
from ray.cluster_utils import Cluster
node = dict(num_cpus=3, resources={"rlhf_device": 2})
cluster = Cluster(initialize_head=True, head_node_args=node)
cluster.add_node(**node)
cluster.wait_for_nodes()
print(json.dumps({"address": cluster.address}), flush=True)
sys.stdin.read()  # until the test closes our stdin
gcs = cluster.head_node.gcs_address
cluster.shutdown()
# Cluster wrote its address to /tmp/ray/ray_current_cluster and leaves it: a later plain ray.init() on this machine
# would try to join the dead cluster.
if ray._private.utils.read_ray_address() == gcs:
    os.remove(ray._private.utils.get_ray_address_file(None))
"""


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


@pytest.fixture(scope="module")
def cluster():
    import psutil

    # the cluster's processes keep their temp files in a dir of their own, removed at the end (a raylet or dashboard
    # that is killed never runs multiprocessing's exit handler, which removes its /tmp/pymp-* dir)
    tmp = tempfile.mkdtemp(prefix="rlhf-2nodes-", dir="/tmp")
    helper = subprocess.Popen([sys.executable, "-c", CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=_env(TMPDIR=tmp))
    try:
        line = helper.stdout.readline()
        assert line, "the two-node cluster did not start"
        yield json.loads(line)["address"]
    finally:
        tree = psutil.Process(helper.pid).children(recursive=True)
        helper.stdin.close()
        try:
            helper.wait(timeout=120)
        except subprocess.TimeoutExpired:
            helper.kill()
        for p in tree:  # anything of the cluster's that outlived its shutdown
            try:
                p.kill()
            except psutil.Error:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


def _overrides(d: Path, out: Path, *extra: str) -> list[str]:
    return [f"model.path={d}", f"data.train_files=[{d / 'train.jsonl'}]", f"data.heldout_files=[{d / 'heldout.jsonl'}]",
            f"output_dir={out}", f"tracking.dir={out}", f"checkpoint.dir={out / 'ckpt'}", f"steps={STEPS}",
            "eval_every=100", "checkpoint.export_hf=false", *extra]


def _on_cluster(address: str, config: str, overrides: list[str]) -> dict:
    """`rlhf train` as a Ray job's driver runs it: its own process, the cluster at RAY_ADDRESS."""
    r = subprocess.run([sys.executable, "-m", "rlhf.cli", "train", str(REPO / "configs" / config), *overrides],
                       capture_output=True, text=True, timeout=900, cwd=REPO, env=_env(RAY_ADDRESS=address))
    assert r.returncode == 0, f"the two-node run failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


COMPARED = ("accuracy/", "actor/", "expert_load/", "parity/", "response/", "reward/", "rollout/groups",
            "rollout/generated_tokens", "sync/bytes_minimal", "sync/bytes_per_engine_rank_max", "sync/version")


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k.startswith(COMPARED)} for row in rows]


@pytest.mark.parametrize("config,spread", [
    ("tiny_cpu_disaggregated.yaml", ["placement.nodes=2", "placement.devices_per_node=2"]),
    # the trainer's expert all-to-all in two hops across the nodes (trainer.hierarchical_ep): bit-identical to
    # the one-node run's flat one
    ("tiny_cpu.yaml", ["placement.nodes=2", "placement.devices_per_node=1", "placement.cpus_per_device=2",
                       "trainer.hierarchical_ep=true"]),
], ids=["disaggregated", "colocated-one-device-per-node"])
def test_two_nodes_give_the_one_node_run(cluster, tiny, ray_session, tmp_path, config, spread):
    d, _ = tiny
    t0 = time.time()
    two = _on_cluster(cluster, config, _overrides(d, tmp_path / "two", *spread))
    one = train(load_run_config(REPO / "configs" / config, _overrides(d, tmp_path / "one")))
    assert two["steps_run"] == one["steps_run"] == STEPS, f"took {time.time() - t0:.0f} s"
    assert len(set(two["ray_nodes"])) == 2 and len(set(one["ray_nodes"])) == 1  # really spread, really not
    assert two["heldout_accuracy_history"] == json.loads(json.dumps(one["heldout_accuracy_history"]))
    two_m, one_m = _metrics(tmp_path / "two"), _metrics(tmp_path / "one")
    assert len(two_m) == STEPS and all(len(m) > 20 for m in two_m)
    for step, (a, b) in enumerate(zip(two_m, one_m), start=1):
        assert a == b, f"step {step}: " + ", ".join(f"{k} {a.get(k)} != {b.get(k)}" for k in a if a.get(k) != b.get(k))
    if "disaggregated" in config:  # across nodes nothing goes through shared memory
        rows = [json.loads(line) for line in (tmp_path / "two" / "steps.jsonl").read_text().splitlines()]
        assert all(r["sync/bytes_shm"] == 0 and r["sync/bytes_received"] == r["sync/bytes_minimal"] for r in rows)
