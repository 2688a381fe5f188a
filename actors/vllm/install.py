"""Install a worker's staged weights into vLLM's model directly: each layer's post-load processing on buffers
that already hold vLLM's (checkpoint-format) parameters, without vLLM's layer-wise reload.

Where it is used: on cpu, where vLLM processes weights after loading (oneDNN handlers for linear layers, the
MoE prepack) so a sync cannot write into the parameters it serves from. The staging buffers of a sync are
already in vLLM's parameter names and shapes (`rlhf.sharding.engine`): fused qkv, merged gate/up,
stacked experts, this worker's TP slice and local experts, vocabulary padding rows zero. What vLLM's reload
does with them (`reload.layerwise`: meta tensors, a wrapper around every weight loader, element counting,
the loaders narrowing and copying each HF tensor) only rebuilds those same buffers: about 70 % of an install
of the tiny model (`benchmarks.install_bench`). This does what remains, per layer, in vLLM's own order:

- a layer with a quant method vLLM ships for unquantized weights (linear, embedding / LM head, fused MoE), for
  block-FP8 ones (`Fp8LinearMethod`, `Fp8MoEMethod`: values and `weight_scale_inv` staged, the cpu kernels'
  VNNI prepack done by their processing; rollout.quantization=fp8_block), or for W8A8 int8 ones
  (`CompressedTensorsLinearMethod` with its int8 scheme, `CompressedTensorsW8A8Int8MoEMethod`: values and
  `weight_scale` staged, packed by their processing; int8_channel):
  its parameters replaced by copies of the staged buffers, the method's `process_weights_after_loading`
  (the MoE one on its first-load path: kernel built, experts prepacked; `actors.vllm.worker_ext` says why), then the
  processed values copied into the layer's previous parameter storage and those parameters put back
  (vLLM's `_copy_and_restore_kernel_tensors`: whatever held them still sees the new values);
- any other parameter (norms): copied in place;
- then every attention layer's own post-load processing, as vLLM's reload finalizes (MLA derives its
  absorbed projections from `kv_b_proj` there).

Copies, not the staging buffers themselves, go into the layers: the next sync receives into the staging
buffers while the engine may still serve, so nothing vLLM keeps may alias them. A model with a layer of
another kind (a quantized method, a parameter that is not staged) gets None from `DirectInstall.build`,
and the worker keeps vLLM's reload. Exactness is the tests': logprobs after a sync equal a fresh engine's on
the same weights (tests/dist/test_engine_reshard.py), and the direct install equals vLLM's reload bit for bit
(tests/e2e/test_vllm_update.py).

`counts_remembered` makes that reload, where it is still taken, cheaper (its docstring says how).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

log = logging.getLogger(__name__)


def _processed_methods() -> tuple[type, ...]:
    """vLLM's quant methods for unquantized weights, whose post-load processing this module replays."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    known = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, UnquantizedFusedMoEMethod)
    try:  # block FP8 (rollout.quantization=fp8_block) and W8A8 int8 (int8_channel, compressed-tensors): the linear
        # and MoE methods, whose processing prepacks
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
            CompressedTensorsLinearMethod)
        from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
            compressed_tensors_moe_w8a8_int8 as int8_moe)
        from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
    except ImportError:  # another vLLM build: its quantized layers are refused by name
        return known
    return known + (Fp8LinearMethod, Fp8MoEMethod, CompressedTensorsLinearMethod,
                    int8_moe.CompressedTensorsW8A8Int8MoEMethod)


@dataclass
class _Layer:
    module: torch.nn.Module
    names: dict[str, str]  # attribute -> staged buffer name


def _holder(model: torch.nn.Module, module_name: str, attrs: set[str]) -> torch.nn.Module | None:
    """The module whose own parameters the staged `module_name.<attr>` names: that module, or else its one
    descendant holding them (vLLM 0.32 keeps `mlp.experts.w13_weight` in `mlp.experts.routed_experts`)."""
    try:
        top = model.get_submodule(module_name)
    except AttributeError:
        return None
    found = [m for m in top.modules() if attrs <= {n for n, p in m._parameters.items() if p is not None}]
    return top if top in found else found[0] if len(found) == 1 else None


class DirectInstall:
    """Built once per worker and staging layout; called with the staged buffers after every intact receive."""

    def __init__(self, processed: list[_Layer], plain: list[tuple[torch.Tensor, str]],
                 attention: list[torch.nn.Module], dtype: torch.dtype):
        self.processed, self.plain, self.attention, self.dtype = processed, plain, attention, dtype

    @classmethod
    def build(cls, model: torch.nn.Module, buffers: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
              dtypes: Mapping[str, torch.dtype] | None = None) -> "DirectInstall | None":
        """The install for staging buffers of these names and shapes, or None (and why, logged) when some layer
        is not one this module knows how to process. `dtype`: the model's; `dtypes`: each buffer's where they
        differ (quantized weights and their scales)."""
        from vllm.model_executor.layers.attention import is_deferred_attention_layer

        known = _processed_methods()
        by_module: dict[str, dict[str, str]] = {}
        for name in buffers:
            module_name, _, attr = name.rpartition(".")
            by_module.setdefault(module_name, {})[attr] = name
        holders = {}
        for module_name, names in by_module.items():
            holders[module_name] = _holder(model, module_name, set(names))
            if holders[module_name] is None:
                return cls._refuse(f"no module of the engine's model at {module_name!r} holds {sorted(names)}")
        staged_params = {id(holders[m]._parameters[a]) for m, names in by_module.items() for a in names}
        processed, plain = [], []
        for module_name, names in by_module.items():
            module = holders[module_name]
            qm = getattr(module, "quant_method", None)
            own = {n: p for n, p in module._parameters.items() if p is not None}
            if qm is not None:
                if type(qm) not in known:  # exactly vLLM's: a subclass may process differently
                    return cls._refuse(f"{module_name} has quant method {type(qm).__name__}")
                # every parameter of the layer is staged here, or is one staged under another module (DeepSeek-V3's
                # experts share the gate's correction bias): nothing the processing reads is left unset
                unstaged = sorted(n for n, p in own.items() if n not in names and id(p) not in staged_params)
                if unstaged or not set(names) <= set(own):
                    return cls._refuse(f"{module_name} holds {sorted(own)}, the sync stages {sorted(names)}")
                processed.append(_Layer(module, names))
                continue
            if callable(getattr(module, "process_weights_after_loading", None)):  # derives something from them
                return cls._refuse(f"{module_name} processes its weights after loading")
            for attr, name in names.items():
                p = own.get(attr)
                want = (dtypes or {}).get(name, dtype)
                if p is None or tuple(p.shape) != tuple(buffers[name]) or p.dtype != want:
                    return cls._refuse(f"{name}: no {want} parameter of shape {tuple(buffers[name])} to copy into")
                plain.append((p, name))
        attention = [m for m in model.modules() if is_deferred_attention_layer(m)]
        return cls(processed, plain, attention, dtype)

    def targets(self) -> list[torch.Tensor]:
        """The parameters every install overwrites in full: the plain ones and every parameter of a processed
        layer (what a level-2 sleep may release; the processed layers' derived state, such as oneDNN handlers
        and the MoE kernel, is rebuilt from the staged copies, never read from these)."""
        return [p for p, _ in self.plain] + [p for layer in self.processed
                                              for p in layer.module._parameters.values() if p is not None]

    @staticmethod
    def _refuse(why: str) -> None:
        log.warning("weights install through vLLM's reload: %s", why)
        return None

    @torch.no_grad()
    def __call__(self, staged: Mapping[str, torch.Tensor], copied: Callable[[list], object] | None = None) -> int:
        """Install every staged buffer; returns how many. An exception leaves a mix of versions (the caller
        must not serve). `copied(buffers)`: called with each layer's staged buffers once they are copied out
        (the worker hands their pages back as it goes: the whole staged copy and the whole installed one never
        coexist)."""
        copied = copied or (lambda buffers: None)
        for p, name in self.plain:
            p.data.copy_(staged[name])
        copied([staged[name] for _, name in self.plain])
        for layer in self.processed:
            self._process(layer, staged, copied)
        for module in self.attention:
            module.process_weights_after_loading(self.dtype)
        return len(self.plain) + sum(len(layer.names) for layer in self.processed)

    @staticmethod
    def _process(layer: _Layer, staged: Mapping[str, torch.Tensor], copied: Callable[[list], object]) -> None:
        module = layer.module
        qm = module.quant_method
        kernel = {n: p for n, p in module._parameters.items() if p is not None}
        for attr, name in layer.names.items():
            module.register_parameter(attr, torch.nn.Parameter(staged[name].clone(), requires_grad=False))
        copied([staged[name] for name in layer.names.values()])
        saved_kernel = getattr(qm, "moe_kernel", None)
        if saved_kernel is not None:
            qm.moe_kernel = None  # vLLM's first-load path: replace, build the kernel, prepack (actors.vllm.worker_ext)
        try:
            qm.process_weights_after_loading(module)
            if hasattr(module, "update_param_tp_status"):
                module.update_param_tp_status()
            for attr, p in kernel.items():
                p.data.copy_(getattr(module, attr))
        finally:
            if saved_kernel is not None and qm.moe_kernel is None:
                qm.moe_kernel = saved_kernel
            for attr, p in kernel.items():
                module.register_parameter(attr, p)


def _count_key(loader, args):
    """What decides the elements a weight loader copies: the loader (and the layer it is bound to), the
    shapes and dtypes of its tensors and its other arguments (shard id, expert id, checkpoint name). None
    when an argument is neither a tensor nor hashable (then the count is not remembered)."""
    parts = []
    for k, v in args.arguments.items():
        if isinstance(v, torch.Tensor):
            parts.append((k, tuple(v.shape), v.dtype))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            parts.append((k, v))
    return getattr(loader, "__func__", loader), id(getattr(loader, "__self__", None)), tuple(parts)


@contextmanager
def counts_remembered(memo: dict):
    """vLLM's layer-wise reload runs every weight loader twice: once on meta tensors under a dispatch mode
    that counts the elements it copies (to know when a layer is complete), then for real. The count and
    the loader's return value depend only on what `_count_key` reads, so after the first update they are
    looked up: the reload does the same work, minus that first pass (about half its time on the tiny
    model). Without the hook (another vLLM build) the reload runs unchanged."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise
    except ImportError:
        yield
        return
    original = getattr(layerwise, "get_numel_loaded", None)
    if original is None:
        yield
        return

    def remembered(loader, args):
        key = _count_key(loader, args)
        if key is None:
            return original(loader, args)
        if key not in memo:
            memo[key] = original(loader, args)
        return memo[key]

    layerwise.get_numel_loaded = remembered
    try:
        yield
    finally:
        layerwise.get_numel_loaded = original
