"""The code verifier inside a Ray actor (the reward worker the driver spawns): programs run in sandboxes
under the actor's threads, scores come back in order, and nothing the programs started outlives the call."""

import json
import os
import time


def _alive(marker: bytes) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/stat", "rb") as f:
                zombie = f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if marker in cmd and not zombie:
            return True
    return False


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _children(ppid: int) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == ppid:
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_ray_reward_worker_scores_programs_and_leaves_nothing_behind(ray_session):
    import ray

    from actors.reward import RuleRewardWorker
    from rlhf.schema import RewardKind, SandboxConfig

    from rlhf.data.sandbox_box import box_problem
    from rlhf.schema import SandboxIsolation

    # in the box where this machine can make it (tests/unit/rlhf/data/test_sandbox_box.py says why it cannot)
    isolation = SandboxIsolation.kernel if box_problem() is None else SandboxIsolation.process
    worker = ray.remote(RuleRewardWorker).options(num_cpus=0).remote(
        RewardKind.code, SandboxConfig(timeout_s=2.0, processes=2, isolation=isolation))
    stdio = json.dumps({"inputs": ["2 3\n"], "outputs": ["5"]})
    responses = ["```python\nprint(sum(map(int, input().split())))\n```",
                 "import subprocess\nsubprocess.Popen(['sleep', '59.8765'])\nprint(5)\n",  # right, and leaves a child
                 "while True:\n    pass\n",
                 "print(6)"]
    before = set(os.listdir("/dev/shm"))
    out = ray.get(worker.score.remote(responses, [stdio] * 4, ["p"] * 4), timeout=60)
    assert out.scores == [1.0, 1.0, 0.0, 0.0]
    deadline = time.time() + 5
    while _alive(b"59.8765") and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(b"59.8765")
    assert set(os.listdir("/dev/shm")) <= before
    # the worker's warm interpreters (one per process slot) go with it when it is killed
    actor_pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
    servers = [pid for pid in _children(actor_pid) if b"recv_fds" in _cmdline(pid)]
    assert len(servers) == 2
    ray.kill(worker)
    deadline = time.time() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in servers) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{pid}") for pid in servers)
