"""An engine whose engine core runs in a process of its own (an engine made in a test or notebook process, or
`rollout.engine_core_in_process=false`) leaves nothing running when the process that made it is killed outright,
while the engine starts or once it serves: vLLM's engine core and workers end (actors/vllm/owner_watch.py), and
no shared-memory segment stays."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlhf.config import load_model_config
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]

OWNER = """
import sys, time
from actors.vllm.engine import VLLMEngine
from rlhf.schema import DeviceType, RolloutConfig

if __name__ == "__main__":
    cfg = RolloutConfig(cpu_kv_cache_gib=0.1, enforce_eager=True, engine_core_in_process=False)
    engine = VLLMEngine(sys.argv[1], cfg, device_type=DeviceType.cpu, max_model_len=64)
    print("serving", flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("policy")
    m = Qwen3MoeForCausalLM(load_model_config(str(REPO / "configs" / "model" / "qwen3_moe_tiny.yaml")))
    m.init_weights(0)
    save_tokenizer(build_tokenizer(m.config.vocab_size), d)
    save_pretrained(m, d)
    return d


def running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # reparented on its parent's death: whoever reaps may be slow
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("killed", ["starting", "serving"])
def test_the_engines_processes_end_with_their_killed_owner(model_dir, tmp_path, killed):
    (tmp_path / "owner.py").write_text(OWNER)
    shm_before = set(os.listdir("/dev/shm"))
    owner = subprocess.Popen([sys.executable, str(tmp_path / "owner.py"), str(model_dir)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    seen: dict[int, psutil.Process] = {}
    try:
        if killed == "serving":
            assert owner.stdout.readline().strip() == "serving", "the engine did not start"
        deadline = time.monotonic() + 180
        while not any("EngineCore" in p.name() for p in seen.values()) and time.monotonic() < deadline:
            seen.update((p.pid, p) for p in psutil.Process(owner.pid).children(recursive=True))
            time.sleep(0.2)
        seen.update((p.pid, p) for p in psutil.Process(owner.pid).children(recursive=True))
        assert any("EngineCore" in p.name() for p in seen.values()), "no engine core process of its own"
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 90
        while any(running(p) for p in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p.pid for p in seen.values() if running(p)], "vLLM processes outlived the engine's owner"
        assert not set(os.listdir("/dev/shm")) - shm_before
    finally:
        owner.kill()
        for p in seen.values():
            if running(p):
                os.kill(p.pid, signal.SIGKILL)
