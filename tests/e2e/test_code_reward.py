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


def test_a_ray_reward_worker_scores_programs_and_leaves_nothing_behind(ray_session):
    import ray

    from actors.reward import RuleRewardWorker
    from rlhf.schema import RewardKind, SandboxConfig

    worker = ray.remote(RuleRewardWorker).options(num_cpus=0).remote(
        RewardKind.code, SandboxConfig(timeout_s=2.0, processes=2))
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
    ray.kill(worker)
