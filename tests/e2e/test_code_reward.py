"""The code verifier inside a Ray actor (the reward worker the driver spawns): programs run in sandboxes
under the actor's threads, scores come back in order, and nothing the programs started outlives the call."""

import json
import os
import tempfile
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
    # its box's directories (kernel isolation) stay until the next worker on the machine removes them
    from rlhf.data import sandbox_box

    while os.path.exists(f"/proc/{actor_pid}") and time.time() < deadline + 10:
        time.sleep(0.05)
    left = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith((f"{sandbox_box.ROOT_PREFIX}{actor_pid}-",
                                                                          f"{sandbox_box.WORK_PREFIX}{actor_pid}-"))]
    assert sorted(left) == sorted(n for n in sandbox_box.remove_dead_dirs() if str(actor_pid) in n)
    assert len(left) == (2 if isolation is SandboxIsolation.kernel else 0)


def test_a_released_reward_worker_leaves_no_directory_when_it_is_killed(ray_session):
    """What the driver's shutdown does (`Roles.shutdown`): each reward worker lets go of its programs' warm
    interpreters, box and precompiled header before it is killed, since a killed actor runs no exit handler."""
    import ray

    from actors.reward import RuleRewardWorker
    from rlhf.data.sandbox_box import ROOT_PREFIX, WORK_PREFIX, box_problem
    from rlhf.data.sandbox_cpp import PCH_PREFIX
    from rlhf.schema import RewardKind, SandboxConfig, SandboxIsolation

    isolation = SandboxIsolation.kernel if box_problem() is None else SandboxIsolation.process
    worker = ray.remote(RuleRewardWorker).options(num_cpus=0).remote(
        RewardKind.code, SandboxConfig(timeout_s=5.0, processes=1, isolation=isolation))
    actor_pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))

    def dirs() -> list[str]:
        return [n for n in os.listdir(tempfile.gettempdir())
                if any(n.startswith(f"{p}{actor_pid}-") for p in (PCH_PREFIX, ROOT_PREFIX, WORK_PREFIX))]

    stdio = json.dumps({"inputs": ["2 3\n"], "outputs": ["5"]})
    cpp = '```cpp\n#include <cstdio>\nint main() { int a, b; scanf("%d %d", &a, &b); printf("%d\\n", a + b); }\n```'
    out = ray.get(worker.score.remote([cpp, "print(sum(map(int, input().split())))"], [stdio] * 2), timeout=120)
    assert out.scores == [1.0, 1.0]
    made = dirs()
    assert any(n.startswith(PCH_PREFIX) for n in made)
    assert any(n.startswith(WORK_PREFIX) for n in made) == (isolation is SandboxIsolation.kernel)
    servers = [pid for pid in _children(actor_pid) if b"recv_fds" in _cmdline(pid)]
    assert servers
    ray.get(worker.release.remote(), timeout=60)
    assert dirs() == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in _children(actor_pid) if pid in servers)
    ray.kill(worker)
    assert dirs() == []
