"""What an engine's processes leave behind when they are killed, and who removes it."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from actors.vllm import platform as vllm_platform
from actors.vllm.platform import IPC_PREFIX, ipc_dir, remove_dead_ipc_dirs, remove_leftover_shm

REPO = Path(__file__).resolve().parents[4]


def test_socket_dirs_of_dead_processes_go_and_live_ones_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_platform, "TEMP_BASE", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    gone = ipc_dir(int(dead.stdout))
    gone.mkdir()
    (gone / "a-socket").touch()
    mine = ipc_dir()
    mine.mkdir()
    other = tmp_path / f"{IPC_PREFIX}not-a-pid"
    other.mkdir()
    assert remove_dead_ipc_dirs() == [gone.name]
    assert not gone.exists() and mine.exists() and other.exists()
    assert mine == tmp_path / f"{IPC_PREFIX}{os.getpid()}"


def test_leftover_segments_of_one_engine_only(tmp_path):
    for name in ("eng1-a", "eng1-b", "eng10-a", "other"):
        (tmp_path / name).touch()
    assert sorted(remove_leftover_shm(["eng1"], shm_dir=str(tmp_path))) == ["eng1-a", "eng1-b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eng10-a", "other"]


PLATFORM_ENV = ("VLLM_RPC_BASE_PATH", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_STREAM",
                "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "VLLM_CPU_OMP_THREADS_BIND", "TORCH_COMPILE_DISABLE", "TMPDIR",
                "RLHF_VLLM_OWNER_PID", "VLLM_PLUGINS")


def unset_for_the_test(monkeypatch) -> None:
    """Unset what `prepare_platform` sets, and have the test's end put each back as it was: set to its old value or
    absent. (`delenv` of an absent variable records nothing, so a value the test set stayed: a TMPDIR left in
    the test's tmp_path made a later Ray start in the same pytest process fail on a socket path over 107 bytes.)"""
    for key in PLATFORM_ENV:
        monkeypatch.setenv(key, "")  # remembers the old value, or that there was none
        monkeypatch.delenv(key)


def test_the_platform_points_vllm_sockets_into_the_process_dir(tmp_path, monkeypatch):
    from rlhf.schema import DeviceType, RolloutConfig

    monkeypatch.setattr(vllm_platform, "TEMP_BASE", str(tmp_path))
    unset_for_the_test(monkeypatch)
    vllm_platform.prepare_platform(DeviceType.cpu, RolloutConfig())
    assert os.environ["VLLM_RPC_BASE_PATH"] == str(ipc_dir()) and stat.S_ISDIR(os.stat(ipc_dir()).st_mode)
    assert "TMPDIR" not in os.environ or os.environ["TMPDIR"] != str(ipc_dir())  # this process is not the engine's


def test_an_engine_process_of_its_own_keeps_all_of_vllm_temp_files_in_its_dir(tmp_path, monkeypatch):
    from rlhf.schema import DeviceType, RolloutConfig

    monkeypatch.setattr(vllm_platform, "TEMP_BASE", str(tmp_path))
    monkeypatch.setattr(vllm_platform.tempfile, "tempdir", vllm_platform.tempfile.tempdir)
    unset_for_the_test(monkeypatch)
    vllm_platform.prepare_platform(DeviceType.cpu, RolloutConfig(), own_process=True)
    assert os.environ["TMPDIR"] == vllm_platform.tempfile.gettempdir() == str(ipc_dir())
    assert ipc_dir().parent == tmp_path  # computed from the machine's temp dir, not the redirected one



@pytest.mark.parametrize("tmpdir_set", [False, True])
def test_an_engine_in_a_shared_process_names_its_temp_files_in_its_dir_while_it_starts(tmp_path, monkeypatch,
                                                                                     tmpdir_set):
    """vLLM's executor names a file store in the temp directory when the engine starts (and never removes it):
    inside `engine_temp_dir` that is the process's socket directory; afterwards the temp directory is as it was,
    also when the start fails."""
    import tempfile

    monkeypatch.setattr(vllm_platform, "TEMP_BASE", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    unset_for_the_test(monkeypatch)
    if tmpdir_set:
        monkeypatch.setenv("TMPDIR", str(tmp_path))
    before = tempfile.gettempdir()
    ipc_dir().mkdir()
    with pytest.raises(RuntimeError, match="engine failed"):
        with vllm_platform.engine_temp_dir():
            assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(ipc_dir())
            store = tempfile.NamedTemporaryFile(prefix="vllm_dist_", delete=False).name  # as vLLM names its own
            raise RuntimeError("engine failed")
    assert os.path.dirname(store) == str(ipc_dir())
    assert tempfile.gettempdir() == before and os.environ.get("TMPDIR") == (str(tmp_path) if tmpdir_set else None)

NO_COMPILE_CHECK = """
import os, threading
import torch
from torch._dynamo.utils import counters
from actors.vllm.platform import prepare_platform
from rlhf.schema import DeviceType, RolloutConfig

@torch.compile(backend="eager")  # dynamo traces (counted) without a C++ build
def count_greater(x, v):  # as vLLM's sampler does
    return (x >= v).sum(-1)

prepare_platform(DeviceType.cpu, RolloutConfig(enforce_eager={eager}), own_process=True)
x = torch.arange(12.0).view(3, 4)
out = []
t = threading.Thread(target=lambda: out.append(count_greater(x, x[:, 1:2]).tolist()))  # as a Ray actor's call runs
t.start()
t.join()
print(out[0], os.environ.get("TORCH_COMPILE_DISABLE"), sum(counters["stats"].values()) > 0)
"""


def test_eager_cpu_engines_compile_nothing_on_any_thread(tmp_path):
    """rollout.enforce_eager on cpu: the torch.compile'd functions vLLM keeps (its sampler's rank counter, an
    inductor C++ build of ~18 s per engine process) run eagerly on every thread, and the engine's workers are
    told so; without enforce_eager dynamo traces as vLLM intends."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("TORCH_COMPILE_DISABLE", None)
    eager, compiled = (subprocess.run([sys.executable, "-c", NO_COMPILE_CHECK.format(eager=e)], capture_output=True,
                                      text=True, env=env, timeout=300) for e in (True, False))
    assert eager.returncode == 0, eager.stderr[-2000:]
    assert eager.stdout.split() == ["[3,", "3,", "3]", "1", "False"]  # same result, env for workers, nothing traced
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert compiled.stdout.split()[-2:] == ["None", "True"]


EAGER_THEN_COMPILED = """
import json, os, tempfile
import torch
from torch._dynamo.utils import counters
from actors.vllm.platform import prepare_platform
from rlhf.schema import DeviceType, RolloutConfig

@torch.compile(backend="eager")
def double(x):
    return x * 2

temp = tempfile.gettempdir()
prepare_platform(DeviceType.cpu, RolloutConfig(enforce_eager=True))  # an eager engine in this process first
eager = os.environ.get("TORCH_COMPILE_DISABLE")
prepare_platform(DeviceType.cpu, RolloutConfig(enforce_eager=False), own_process=True)
double(torch.ones(2))
print(json.dumps([eager, os.environ.get("TORCH_COMPILE_DISABLE"), sum(counters["stats"].values()) > 0,
                  os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(temp + "/torchinductor_"),
                  os.environ["VLLM_DISABLE_COMPILE_CACHE"], tempfile.gettempdir() != temp]))
"""


def test_a_compiled_engine_compiles_after_an_eager_one_and_keeps_its_kernels(tmp_path):
    """rollout.enforce_eager=false after an eager engine in the same process: torch.compile is on again (its
    workers would inherit TORCH_COMPILE_DISABLE), inductor's kernels go to torch's shared cache under the machine's
    temp directory, not the engine's own (removed with it), and vLLM's graph cache (never loaded on cpu) is off.
    A user's own TORCH_COMPILE_DISABLE stays."""
    import json

    env = dict(os.environ, TMPDIR=str(tmp_path))
    for name in ("TORCH_COMPILE_DISABLE", "TORCHINDUCTOR_CACHE_DIR", "VLLM_DISABLE_COMPILE_CACHE"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", EAGER_THEN_COMPILED], capture_output=True, text=True, env=env,
                         timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.splitlines()[-1]) == ["1", None, True, True, "1", True]
    users = subprocess.run([sys.executable, "-c", EAGER_THEN_COMPILED], capture_output=True, text=True,
                           env=dict(env, TORCH_COMPILE_DISABLE="1"), timeout=300, cwd=REPO)
    assert users.returncode == 0, users.stderr[-2000:]
    assert json.loads(users.stdout.splitlines()[-1])[:3] == ["1", "1", False]


def test_fp32_mla_engines_on_cpu_take_the_reference_mla_backend(tmp_path):
    """vLLM's AMX MLA kernels (its choice on cpus with AMX tiles) take bf16 weights only: an fp32 DeepSeek-V3
    family engine on cpu asks for the reference cpu MLA backend; bf16, other models and GPUs keep vLLM's choice."""
    import json
    from pathlib import Path

    from actors.vllm.platform import attention_kwargs
    from rlhf.config import load_model_config
    from rlhf.model.hf_io import hf_config
    from rlhf.schema import DeviceType, DType, RolloutConfig

    models = Path(__file__).resolve().parents[4] / "configs" / "model"
    mla, qwen = tmp_path / "mla", tmp_path / "qwen"
    for d, yaml in ((mla, "pangu_moe_tiny.yaml"), (qwen, "qwen3_moe_tiny.yaml")):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf_config(load_model_config(models / yaml))))
    fp32, bf16 = RolloutConfig(dtype=DType.float32), RolloutConfig(dtype=DType.bfloat16)
    assert attention_kwargs(DeviceType.cpu, fp32, mla) == {"attention_config": {"backend": "CPU_MLA"}}
    assert attention_kwargs(DeviceType.cpu, bf16, mla) == {}
    assert attention_kwargs(DeviceType.cpu, fp32, qwen) == {}
    assert attention_kwargs(DeviceType.cuda, fp32, mla) == {}


HOLD = """
import sys, time
from multiprocessing import shared_memory
m = shared_memory.SharedMemory(create=True, size=4096)
print(m.name, flush=True)
sys.stdin.readline()
m.close(); m.unlink()
"""


def test_the_segments_a_process_tree_holds_are_named_and_removable(tmp_path):
    """`held_shm`: the multiprocessing segments a process and its descendants have mapped (an engine actor's
    message queues), not those of other processes; `remove_leftover_shm` takes exact names as well as prefixes."""
    from multiprocessing import shared_memory

    mine = shared_memory.SharedMemory(create=True, size=4096)
    child = subprocess.Popen([sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = child.stdout.readline().strip()
        assert vllm_platform.held_shm(child.pid) == [theirs]  # the child's only
        assert {mine.name, theirs} <= set(vllm_platform.held_shm())  # this process and its descendants
    finally:
        child.communicate("\n", timeout=30)
        mine.close()
        mine.unlink()
    for name in ("psm_ab12", "psm_ab123", "ident-x", "identx"):
        (tmp_path / name).touch()
    assert sorted(remove_leftover_shm(["psm_ab12", "ident"], shm_dir=str(tmp_path))) == ["ident-x", "psm_ab12"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identx", "psm_ab123"]


def test_tqdm_bars_make_no_named_semaphore_once_told():
    """vLLM's weight loading shows tqdm bars; tqdm's default lock across processes is a named semaphore that a
    killed process leaves in /dev/shm (where multiprocessing spawns, as vLLM's processes do). After
    `no_tqdm_semaphore` a first bar makes none (a fresh process: tqdm makes its lock once per process)."""
    code = """
import multiprocessing, os, sys
multiprocessing.set_start_method("spawn")
sys.path.insert(0, %r)
from actors.vllm.platform import SEMAPHORE_PREFIX, no_tqdm_semaphore
sems = lambda: {n for n in os.listdir("/dev/shm") if n.startswith(SEMAPHORE_PREFIX)}
before = sems()
if sys.argv[1] == "told":
    no_tqdm_semaphore()
from tqdm import tqdm
for _ in tqdm(range(2), disable=True):
    pass
print(len(sems() - before))
""" % str(REPO)
    made = {how: subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60)
            for how in ("default", "told")}
    assert [made[h].stdout.strip() for h in ("default", "told")] == ["1", "0"], {h: r.stderr for h, r in made.items()}


def test_paused_gc_turns_the_collector_off_and_back_as_it_was():
    import gc

    from actors.vllm.platform import paused_gc

    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        assert gc.collect() >= 0  # an explicit collection (vLLM's own) still runs
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("an engine that fails to start")
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


def test_the_heap_stays_frozen_through_an_own_process_engines_close():
    """`heap_kept_frozen`: vLLM's shutdown unfreezes the heap and collects it all (about 1 s of CPU for a tiny
    engine); an engine whose process ends after its close keeps it frozen instead, and unfreezing works again
    afterwards, an exception included."""
    import gc

    from actors.vllm.platform import heap_kept_frozen

    held = [[i] for i in range(1000)]  # tracked objects of our own
    before = gc.get_freeze_count()  # frozen already if an in-process engine core ran here
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen >= len(held)
        with heap_kept_frozen():
            gc.unfreeze()  # what vLLM's shutdown calls
            assert gc.get_freeze_count() == frozen
        with pytest.raises(RuntimeError), heap_kept_frozen():
            raise RuntimeError("a close that fails")
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
        assert gc.get_freeze_count() == 0
        if before:
            gc.freeze()


def test_freeze_heap_freezes_unless_turned_off(monkeypatch):
    """An engine's own process moves its import-time heap to the permanent generation before vLLM starts: the
    collections of vLLM's start walk only what the start makes. Pausing the collector alone freezes nothing (a
    process that hosts more than an engine keeps its heap collectable); RLHF_FREEZE_HEAP=0 turns it off."""
    import gc

    from actors.vllm.platform import freeze_heap, paused_gc

    before = gc.get_freeze_count()  # vLLM's in-process engine core froze this process's heap if one ran here
    try:
        with paused_gc():
            pass
        assert gc.get_freeze_count() == before
        monkeypatch.setenv("RLHF_FREEZE_HEAP", "0")
        freeze_heap()
        assert gc.get_freeze_count() == before
        monkeypatch.setenv("RLHF_FREEZE_HEAP", "false")
        with pytest.raises(ValueError, match=r"RLHF_FREEZE_HEAP='false': use 1 .* or 0"):
            freeze_heap()
        assert gc.get_freeze_count() == before
        monkeypatch.delenv("RLHF_FREEZE_HEAP")
        with paused_gc():
            freeze_heap()
            assert gc.get_freeze_count() > before and not gc.isenabled()
        assert gc.isenabled()
    finally:
        if before == 0:
            gc.unfreeze()


def test_only_vllms_worker_processes_count_as_workers(tmp_path):
    """vLLM's multiprocessing executor names its worker processes `VllmWorker-<rank>`; importing the worker
    extension freezes the heap there only (the driver and the tests import it too)."""
    code = """
import multiprocessing, sys
sys.path.insert(0, %r)
from actors.vllm.platform import in_vllm_worker

def child(q):
    q.put(in_vllm_worker())

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    seen = [in_vllm_worker()]
    for name in ("VllmWorker-0", "VllmWorker-1", "SomeOtherProcess"):
        p = ctx.Process(target=child, args=(q,), name=name)
        p.start()
        seen.append(q.get(timeout=60))
        p.join()
    print(seen)
""" % str(REPO)
    (tmp_path / "workers.py").write_text(code)
    r = subprocess.run([sys.executable, str(tmp_path / "workers.py")], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[False, True, True, False]", r.stderr
