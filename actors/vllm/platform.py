"""What a vLLM engine needs from its process and machine, outside vLLM: environment set before vLLM
loads (logging stream, shutdown grace, in-process engine core, CPU thread binding and KV-cache size, the
NPU device registered), and what its processes leave when they are killed: shared-memory segments, and the
ZeroMQ socket files vLLM binds in the temp directory (never unlinked, even on a clean shutdown), and the file
store each engine's executor names there (`vllm_dist_<uuid>`, never removed either)."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

from actors.vllm.owner_watch import OWNER_ENV, PLUGIN as OWNER_PLUGIN
from rlhf.leftovers import remove_dead_process_dirs, temp_dir
from rlhf.schema import DeviceType, RolloutConfig

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 60.0  # how long vLLM's processes may take to exit cleanly on close
IPC_PREFIX = "rlhf-vllm-ipc-"  # + the pid of the process that hosts the engine
TEMP_BASE = tempfile.gettempdir()  # the machine's temp directory, as this process found it on import


def ipc_dir(pid: int | None = None) -> Path:
    """Where the engines of process `pid` (and their engine-core and worker processes, which inherit the
    environment) bind their ZeroMQ sockets: one directory per hosting process, removed when its last
    engine closes or, if the process was killed, by the next engine started on the machine."""
    return Path(TEMP_BASE) / f"{IPC_PREFIX}{os.getpid() if pid is None else pid}"


def remove_dead_ipc_dirs() -> list[str]:
    """The socket directories of engine-hosting processes that are gone (killed, crashed)."""
    return remove_dead_process_dirs(TEMP_BASE, IPC_PREFIX)


def prepare_platform(device_type: DeviceType, cfg: RolloutConfig, cpu_cores: Sequence[int] | None = None,
                     own_process: bool = False, force_in_process: bool = False) -> None:
    # vLLM logs to stdout by default; our commands keep stdout for their results.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    # the engine's executor waits this long for its workers to exit before killing them (vLLM's 5 s default
    # is too short on a busy machine, and a killed worker leaves its shared memory behind)
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(int(SHUTDOWN_GRACE_S)))
    # vLLM's socket files go into a directory of this process (vLLM reads the variable until its engine core
    # starts, then caches it: one path per process), instead of thousands of stray files in /tmp
    remove_dead_ipc_dirs()
    ipc_dir().mkdir(exist_ok=True)
    os.environ["VLLM_RPC_BASE_PATH"] = str(ipc_dir())
    if device_type is DeviceType.cpu and not cfg.enforce_eager:
        # A compiled engine's kernels in inductor's shared cache (torch's `/tmp/torchinductor_<user>`), not in the
        # engine's own temp directory below, which goes with it: a restarted engine or the next run builds nothing
        # again. vLLM's cache of the compiled graph (in ~/.cache/vllm) never loads on cpu (0.32: "Compiling model
        # again due to a load failure ... no attribute 'finalize_loading'"; its cpu backend is plain inductor), and
        # with it on vLLM points inductor's cache there as well: off unless the user sets it.
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    if own_process:  # vLLM's other temp files (a file store per engine, never removed) go there as well
        os.environ["TMPDIR"] = tempfile.tempdir = str(ipc_dir())
        no_tqdm_semaphore()  # the engine's workers do the same (actors/vllm/worker_ext.py)
    # the processes vLLM starts for this engine end with this process (actors/vllm/owner_watch.py): vLLM loads the
    # watch as a general plugin in each of them; a user's VLLM_PLUGINS allow-list gets it added
    os.environ[OWNER_ENV] = str(os.getpid())
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and OWNER_PLUGIN not in allowed.split(","):
        os.environ["VLLM_PLUGINS"] = ",".join(p for p in (allowed, OWNER_PLUGIN) if p)
    # rollout.engine_core_in_process; by default only where this process is the engine's own (a Ray actor): an
    # in-process engine core binds the process's threads to the engine's core and seeds its global RNG
    in_process = cfg.engine_core_in_process
    if (in_process is None and device_type is DeviceType.cpu and own_process) or force_in_process:
        in_process = True
    if in_process is not None:  # otherwise vLLM's default (or the environment's VLLM_ENABLE_V1_MULTIPROCESSING)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if device_type is DeviceType.cpu:
        # read by the engine workers' experts as they prepare their weights (actors/vllm/cpu_moe.py); set for every
        # engine, so one started later in this process does not inherit an earlier one's choice
        from actors.vllm.cpu_moe import ENV

        os.environ[ENV] = cfg.cpu_moe_kernel.value
        if cfg.enforce_eager:
            no_compile()
        else:
            allow_compile()
        if cpu_cores:
            # One core per engine rank, the core of its stand-in device: vLLM's "auto" binding puts every
            # engine of a machine on core 0 (it reserves the rest), so two engines would share one core.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c) for c in cpu_cores))
        elif cfg.tp > 1:
            # The default "auto" binding fails with "Not enough allowed NUMA nodes" for TP > 1 on one socket.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(cfg.tp)))
    elif device_type is DeviceType.npu:
        import torch_npu  # noqa: F401  (registers the npu device before vllm-ascend loads)


@contextlib.contextmanager
def engine_temp_dir():
    """While an engine starts, the temp directory is this process's socket directory (`ipc_dir`, removed with the
    process's last engine): vLLM's executor names its torch.distributed file store there (`vllm_dist_<uuid>`, in
    this process or the engine-core process it starts, which inherits the setting) and never removes it; in /tmp
    every engine a test, benchmark or notebook started left one. Put back as it was once the engine is up. An
    engine's own process (a Ray actor: `prepare_platform(own_process=True)`) keeps it there for good."""
    target = str(ipc_dir())
    if tempfile.gettempdir() == target:
        yield
        return
    with temp_dir(target):
        yield


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector off while an engine imports vLLM and builds itself (an explicit
    `gc.collect()`, as vLLM's own at the end of its start, still runs); back as it was afterwards. The collector
    otherwise walks the growing import-time heap again and again (modules, classes, pydantic models, nearly all
    of them kept for the process's life), for nothing."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_heap() -> None:
    """Move every object the collector tracks now (once vLLM is imported: its modules, classes and pydantic
    models) to its permanent generation, which no collection walks. vLLM does the same with the whole heap at the
    end of its engine core's and its workers' start (`freeze_gc_heap`); done before the start instead, the
    explicit collections during it (its model loader's two, that freeze's own three) walk only what the start
    makes. For processes that host nothing but an engine (its own, or one of vLLM's workers): objects frozen are
    never collected. `RLHF_FREEZE_HEAP=0`
    in the environment turns it off (to measure it: `benchmarks/engine_start_bench.py`)."""
    import gc

    value = os.environ.get("RLHF_FREEZE_HEAP", "1")
    if value not in ("0", "1"):
        raise ValueError(f"RLHF_FREEZE_HEAP={value!r}: use 1 (freeze the engine's import-time heap, the default) or 0")
    if value == "1":
        gc.freeze()


@contextlib.contextmanager
def heap_kept_frozen():
    """vLLM's shutdown unfreezes the heap its start froze (`gc.unfreeze` in the engine core's and the worker's
    `shutdown` and in `cleanup_dist_env_and_memory`), then collects, so that an engine deleted in a process that goes
    on gives its memory back: three full collections of about 720 k objects, 1 s of CPU at the close of a tiny
    model's engine. For an engine whose process ends right after its close (its Ray actor, killed by
    `Roles.shutdown`) that is work for nothing: here the heap stays frozen and each collection walks only what was
    made since. Restored afterwards."""
    import gc

    unfreeze = gc.unfreeze
    gc.unfreeze = lambda: None
    try:
        yield
    finally:
        gc.unfreeze = unfreeze


def in_vllm_worker() -> bool:
    """This process is one of the worker processes vLLM's multiprocessing executor starts (`VllmWorker-<rank>`):
    a process of the engine's own."""
    import multiprocessing

    return multiprocessing.parent_process() is not None and \
        multiprocessing.current_process().name.startswith("VllmWorker")


def attention_kwargs(device_type: DeviceType, cfg: RolloutConfig, model_dir) -> dict:
    """`LLM` arguments choosing the attention backend where vLLM's own choice fails: on a cpu with AMX tiles it
    picks its AMX MLA kernels for DeepSeek-V3 family models, which take bf16 weights only ("expect weight to
    be bfloat16, ...": an fp32 engine fails to start there); other dtypes
    get its reference cpu MLA backend, the one chosen on cpus without AMX."""
    if device_type is not DeviceType.cpu or cfg.dtype.value == "bfloat16":
        return {}
    from rlhf.model.hf_io import load_config
    from rlhf.schema import Attention

    if load_config(model_dir).attention is Attention.mla:
        return {"attention_config": {"backend": "CPU_MLA"}}
    return {}


def no_compile() -> None:
    """No torch.compile in this process or the engine processes it starts. With enforce_eager vLLM still
    compiles its sampler's logprob-rank counter (`batched_count_greater_than`) with inductor at the first
    generation, on cpu a C++ build that made a run's first evaluation 20 s here, for one comparison and sum
    that runs eagerly with the same result (docs/rollout.md)."""
    import torch

    global _compile_disabled
    if os.environ.get("TORCH_COMPILE_DISABLE") != "1":
        os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read when a worker process imports torch
        _compile_disabled = True
    torch.compiler.set_stance("force_eager")  # every thread (a Ray actor's calls run on threads of their own)


_compile_disabled = False  # TORCH_COMPILE_DISABLE was set by `no_compile`, not by the user


def allow_compile() -> None:
    """Undo `no_compile` for an engine that compiles (`rollout.enforce_eager: false`) in a process that hosted an
    eager one before: its workers would inherit TORCH_COMPILE_DISABLE and run eagerly without a word. A user's own
    TORCH_COMPILE_DISABLE stays."""
    import torch

    global _compile_disabled
    if _compile_disabled:
        os.environ.pop("TORCH_COMPILE_DISABLE", None)
        _compile_disabled = False
    torch.compiler.set_stance("default")


def remove_leftover_shm(prefixes, shm_dir: str = "/dev/shm") -> list[str]:
    """Segments of this engine's processes still in /dev/shm after they ended: a worker that is killed (vLLM
    force-kills those slower than the shutdown grace, e.g. on a busy machine) or crashes never unlinks its
    collectives' segments. Each entry is a prefix unique to the engine (VLLM_DIST_IDENT: `<prefix>-*`) or the
    exact name of a segment its processes held (`held_shm`)."""
    removed = []
    for prefix in prefixes:
        for pattern in (glob.escape(prefix), f"{glob.escape(prefix)}-*"):
            for path in Path(shm_dir).glob(pattern):
                path.unlink(missing_ok=True)
                removed.append(path.name)
    if removed:
        log.warning("engine close: removed %d shared-memory segment(s) its workers left: %s", len(removed), removed)
    return removed


SEGMENT_PREFIX = "psm_"  # Python multiprocessing's shared memory (vLLM's message queues)
SEMAPHORE_PREFIX = "sem.mp-"  # Python multiprocessing's named semaphores
HELD_PREFIXES = (SEGMENT_PREFIX, SEMAPHORE_PREFIX)


def no_tqdm_semaphore() -> None:
    """tqdm's progress bars (vLLM's weight loading, in the engine's process or each of its workers) share a
    multiprocessing lock: a named semaphore (`sem.mp-*`) made at the first bar and unlinked at a normal exit only,
    so a killed engine left one per process (two for a TP 2 engine). A thread lock instead, set with tqdm's own
    `set_lock`: an engine's processes then make no named semaphore that outlives its start (the executor's worker
    lock is unlinked at once), and bars of different processes may interleave their lines."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def held_shm(root_pid: int | None = None, shm_dir: str = "/dev/shm", proc: str = "/proc") -> list[str]:
    """Names of the multiprocessing segments and semaphores (`HELD_PREFIXES`) in `shm_dir` that process `root_pid`
    (this one by default) and its descendants have mapped: for an engine in a process of its own, the message
    queues between its engine core and its workers (sized by vLLM's message-queue settings). vLLM names them at
    random and their owners' resource trackers unlink them, but an engine actor killed outright (a crash,
    `ray.kill`) takes its trackers with it: the engine that replaces it removes them (`stale_shm`). None where
    the system has no /proc."""
    if not os.path.isdir(proc):
        return []
    root = os.getpid() if root_pid is None else root_pid
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            try:
                with open(f"{entry.path}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    names, todo = set(), [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        try:
            with open(f"{proc}/{pid}/maps") as f:
                for line in f:
                    fields = line.split(maxsplit=5)  # address, perms, offset, device, inode[, path]
                    path = fields[5].strip() if len(fields) == 6 else ""
                    name = os.path.basename(path)
                    if os.path.dirname(path) == shm_dir and name.startswith(HELD_PREFIXES):  # "(deleted)": skipped
                        names.add(name)
        except OSError:
            continue
    return sorted(n for n in names if os.path.exists(os.path.join(shm_dir, n)))
