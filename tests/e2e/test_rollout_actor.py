"""The vLLM engine as a Ray actor: generation with logprobs and weight versions, updates, and remote
failures that reach the driver with role and rank instead of hanging it."""

import os

import pytest

from actors.remote import RoleError, spawn
from actors.vllm.platform import SHUTDOWN_GRACE_S
from rlhf.config import load_model_config
from rlhf.schema import RolloutConfig
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

pytestmark = pytest.mark.vllm
TINY = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "model", "qwen3_moe_tiny.yaml")


def test_engine_actor_generates_and_updates(ray_session, tmp_path):
    from actors.vllm.engine import VLLMEngine

    cfg = load_model_config(TINY)
    m1, m2 = Qwen3MoeForCausalLM(cfg), Qwen3MoeForCausalLM(cfg)
    m1.init_weights(1, std=0.1)
    m2.init_weights(2, std=0.1)
    save_tokenizer(build_tokenizer(cfg.vocab_size), tmp_path)
    save_pretrained(m1, tmp_path)
    engine = spawn(VLLMEngine, "rollout", 0, str(tmp_path), RolloutConfig(max_new_tokens=4, cpu_kv_cache_gib=0.25),
                   max_model_len=64)
    try:
        prompts = [[1, 5, 6, 14, 7, 17], [1, 9, 14, 9, 17]]
        out = engine.call("generate", prompts, n=3, seed=0, timeout_s=600)
        assert len(out) == 6 and {c.prompt_index for c in out} == {0, 1}
        assert all(len(c.logp) == len(c.token_ids) > 0 and c.weight_version == 0 for c in out)
        info = engine.call("update_weights", list(to_hf_tensors(m2.state_dict(), cfg)), version=7)
        assert info["version"] == 7
        assert {c.weight_version for c in engine.call("generate", prompts, n=1)} == {7}
        with pytest.raises(RoleError, match=r"rollout rank 0: update_weights raised WeightUpdateRejected"):
            engine.call("update_weights", list(to_hf_tensors(m2.state_dict(), cfg))[:-1], version=8)
    finally:  # vLLM unlinks its shared memory on close; a killed actor cannot
        try:
            engine.call("close", timeout_s=SHUTDOWN_GRACE_S + 60)  # outlasts the grace close gives vLLM's processes
        finally:
            engine.kill()  # also when close failed: the next test's actors take the same names


def test_failures_and_timeouts_name_role_and_rank(ray_session):
    class Slow:  # defined here so Ray ships it by value to the worker
        def wait(self, s):
            import time

            time.sleep(s)

        def fail(self):
            raise ValueError("bad input for this role")

    class Broken:
        def __init__(self, path):
            raise FileNotFoundError(f"{path}: no model.safetensors")

        def ping(self):
            return "never"

    slow = spawn(Slow, "reward", 3, num_cpus=0)
    with pytest.raises(RoleError, match="reward rank 3: fail raised ValueError: bad input"):
        slow.call("fail")
    with pytest.raises(RoleError, match="reward rank 3: wait did not answer within 1 s"):
        slow.call("wait", 30, timeout_s=1)
    # a constructor that raises: the driver sees the cause, not Ray's "the actor died" preamble
    broken = spawn(Broken, "rollout", 1, "/no/such/dir", num_cpus=0)
    with pytest.raises(RoleError, match=r"rollout rank 1: ping failed: the actor could not start "
                                        r"\(FileNotFoundError: /no/such/dir: no model.safetensors\)"):
        broken.call("ping", timeout_s=60)


def test_a_failing_rank_is_reported_at_once_while_its_peer_waits(ray_session):
    import time

    from actors.remote import call_all

    class Rank:
        def __init__(self, fail):
            self.fail = fail

        def step(self):
            import time

            if self.fail:
                raise RuntimeError("shard missing")
            time.sleep(60)  # stands in for a peer blocked in a collective with the failed rank

    peers = [spawn(Rank, "trainer", r, r == 1, num_cpus=0) for r in range(2)]
    t0 = time.monotonic()
    with pytest.raises(RoleError, match="trainer rank 1: step raised RuntimeError: shard missing"):
        call_all([(h, "step", (), {}) for h in peers], timeout_s=120)
    assert time.monotonic() - t0 < 30
    with pytest.raises(RoleError, match="trainer rank 0: step did not answer within 2 s"):
        call_all([(peers[0], "step", (), {})], timeout_s=2)
    for h in peers:
        h.kill()


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_stopped_actor_is_found_hung_by_its_probes_and_a_busy_one_is_not(ray_session):
    """Liveness probes (`spawn(probe_s=...)`): an actor busy in a long call answers them on their own thread,
    so its call runs to the end; one whose process is stopped (SIGSTOP: alive, never answering) fails its call
    as hung within one probe interval (a probe goes out with the call), long before the call's deadline.
    Without probes it waits the deadline."""
    import os
    import signal
    import time

    from actors.remote import call_all, call_each

    class Busy:
        def pid(self):
            return os.getpid()

        def work(self, s):
            import time

            time.sleep(s)
            return s

    a, b = (spawn(Busy, "rollout", k, num_cpus=0, probe_s=2) for k in range(2))
    pid = a.call("pid", timeout_s=120)  # probed calls go to actors already up (one still starting answers no probe)
    b.call("pid", timeout_s=120)
    assert call_all([(a, "work", (4,), {}), (b, "work", (1,), {})], timeout_s=60, probe=True) == [4, 1]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(RoleError, match="rollout rank 0: work hung: its process answered no liveness probe in 2 s") as e:
            call_all([(b, "work", (8,), {}), (a, "work", (1,), {})], timeout_s=120, probe=True)
        assert e.value.hung and not e.value.died and time.monotonic() - t0 < 3.5  # probe_s 2: one interval (two took 4 s)
        assert len(e.value.pending) == 1  # b's call, still running: the caller settles it
        t0 = time.monotonic()  # call_each: the hung call's error in its place, the others' results kept
        got = call_each([(a, "work", (1,), {}), (b, "work", (5,), {})], timeout_s=120, probe=True)
        assert isinstance(got[0], RoleError) and got[0].hung and got[1] == 5 and time.monotonic() - t0 < 20
        with pytest.raises(RoleError, match="rollout rank 0: work did not answer within 3 s"):  # no probes: the deadline
            call_all([(a, "work", (1,), {})], timeout_s=3)
        # killed as hung: its process goes at once, not when Ray's kill gives up waiting for it to exit (5 s)
        a.kill(hung=True)
        t0 = time.monotonic()
        while not _gone(pid):
            assert time.monotonic() - t0 < 2, "a hung actor's process outlived its kill"
            time.sleep(0.05)
    finally:
        a.kill()
        b.kill()
