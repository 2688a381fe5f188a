"""Whether this machine's cpu multiplies half-precision matrices at speed, and the trainer setting it refuses.

torch multiplies bf16 (fp16) matrices on cpu through oneDNN where the cpu has the instructions for it (x86:
AVX-512 with bw / vl / dq, or AMX, or AVX2-VNNI-2; Arm: the bf16 extension). Elsewhere, as on an AVX2-only AMD
EPYC, every bf16 matmul takes torch's reference loop: 1.2 GFLOP/s against 65 GFLOP/s in fp32 on one thread of that
machine (`rlhf calibrate --no-vllm`, 2026-12-01), so a bf16 trainer there runs its update about 50x slower than in
fp32 (one rank's first bf16 update of the small MoE had not finished in 20 minutes; the whole fp32 step: 31-34 s). `compute_dtype_problem` refuses that
before any actor starts (the driver's machine, `rlhf.driver.run.RunInputs`) and in each trainer or reference rank
(its own machine), unless `trainer.allow_slow_cpu_bf16` says to run it anyway (tiny models, numerics tests).
"""

from __future__ import annotations

from rlhf.schema import DeviceType, DType, ModelConfig, TrainerConfig


def half_matmul_fast(dtype: DType) -> bool:
    """Whether torch on this cpu has its oneDNN path for `dtype` matmuls (fp32: always). torch's own check, the one
    its matmul dispatch makes; where it cannot be asked (another torch), True: nothing is refused on a guess."""
    import torch

    check = {DType.bfloat16: "_is_mkldnn_bf16_supported", DType.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if check is None:
        return True
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):
        return True


def compute_dtype_problem(model: ModelConfig, trainer: TrainerConfig, device_type: DeviceType) -> str | None:
    """Why a trainer (or reference) rank of this config must not start on this machine's cpu, or None."""
    dtype = trainer.compute_dtype or model.dtype
    if device_type is not DeviceType.cpu or trainer.allow_slow_cpu_bf16 or half_matmul_fast(dtype):
        return None
    key = "trainer.compute_dtype" if trainer.compute_dtype is not None else "model.dtype"
    fix = ("trainer.compute_dtype=float32" if trainer.compute_dtype is not None and model.dtype is DType.float32
           else "model.dtype=float32 and trainer.compute_dtype=float32")
    return (f"{key} = {dtype.value}: this cpu has no {dtype.value} matmul instructions (torch's fast path needs "
            "AVX-512 with bw/vl/dq, or AMX, on x86; bf16 on Arm), so each of the trainer's matmuls would take "
            "torch's reference loop, about 50x slower than fp32 (rlhf/cpu_matmul.py). Set "
            f"{fix} (and rollout.dtype=float32: vLLM's bf16 is slower than fp32 there too), or "
            "trainer.allow_slow_cpu_bf16=true to run it anyway")
