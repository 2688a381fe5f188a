"""rollout.cpu_moe_kernel on a bf16 cpu engine without AMX: the tiled experts' kernel (actors/vllm/cpu_moe.py)
serves every MoE layer that fits it, computes what vLLM's kernel does within bf16 rounding, and takes weight
updates exactly, by vLLM's reload and by the direct install a sync takes."""

import os

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.config.validate import cpu_has_amx_tiles, tiled_moe_missing
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.schema import CpuMoeKernel, DType, RolloutConfig
from tests.e2e.test_vllm_update import _hf, _ours, _staged  # the helpers of the fp32 engine's tests

WHY = tiled_moe_missing() or ("this cpu has AMX: vLLM's AMX experts' kernel serves, the tiled one never applies"
                              if cpu_has_amx_tiles() else None)
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(WHY is not None, reason=f"the tiled kernel: {WHY}")]
# every expert dimension a multiple of 64 (hidden 256, 2 x intermediate 512): the sizes the kernel tiles
MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "model", "qwen3_moe_fp8_tiny.yaml")


def _model(seed):
    m = Qwen3MoeForCausalLM(load_model_config(MODEL)).eval()
    m.init_weights(seed, std=0.1)
    return m


def _engine(d, kernel, tp=1, ep=1):
    from actors.vllm.engine import VLLMEngine

    return VLLMEngine(str(d), RolloutConfig(dtype=DType.bfloat16, cpu_kv_cache_gib=0.25, tp=tp, ep=ep,
                                            cpu_moe_kernel=CpuMoeKernel(kernel)), max_model_len=64)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("w1")
    m1, m2 = _model(1), _model(2)
    save_tokenizer(build_tokenizer(m1.config.vocab_size), d)
    save_pretrained(m1, d)
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, m1.config.vocab_size, (12, 24), generator=g)
    seqs[:, 0] = 1
    stock = _engine(d, "vllm")
    try:
        assert stock.moe_kernels == {"CPUUnquantizedExperts": 2}
        stock_lp = torch.tensor(stock.sequence_logprobs(seqs.tolist()))
    finally:
        stock.close()
    engine = _engine(d, "tiled")
    yield engine, m1, m2, seqs, stock_lp
    engine.close()


def test_tiled_kernel_serves_what_vllms_does_within_bf16(setup):
    engine, m1, _, seqs, stock = setup
    assert engine.moe_kernels == {"tiled": 2}
    tiled = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    exact = _ours(m1, seqs)  # the fp32 model
    # a bf16 model's rounding moves the logprobs of both kernels alike from the fp32 model's (a flipped route
    # moves one token by up to ~1); the kernels differ by less (measured: mean 0.016, median 0.008; each from the
    # fp32 model: mean 0.031 and 0.032, median 0.016 and 0.015)
    assert (tiled - exact).abs().mean() <= 1.25 * (stock - exact).abs().mean()
    assert (tiled - stock).abs().median() <= 0.03 and (tiled - stock).abs().mean() <= 0.04
    out = engine.generate(seqs[:2, :4].tolist(), n=2, max_tokens=6, seed=0)
    assert [c.token_ids for c in out] == [c.token_ids for c in engine.generate(seqs[:2, :4].tolist(), n=2,
                                                                               max_tokens=6, seed=0)]


def test_updates_are_exact_by_both_installs(setup, tmp_path):
    from safetensors.torch import save_file

    engine, m1, m2, seqs, _ = setup
    fresh = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    engine.update_weights(_hf(m2), version=1)
    lp2 = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    assert (lp2 - fresh).abs().max() > 1e-2
    engine.update_weights(_hf(m1), version=2)
    assert torch.equal(torch.tensor(engine.sequence_logprobs(seqs.tolist())), fresh)
    assert engine.llm.collective_rpc("rlhf_moe_kernels")[0] == {"tiled": 2}  # the update packed for it again
    # the buffers a sync stages for a bf16 tp1 engine
    save_file(dict(_staged(m2, torch.bfloat16)), tmp_path / "w.safetensors")
    engine.llm.collective_rpc("rlhf_install_file", args=(str(tmp_path / "w.safetensors"), "direct"))
    assert engine.llm.reset_prefix_cache()
    assert torch.equal(torch.tensor(engine.sequence_logprobs(seqs.tolist())), lp2)
    assert engine.llm.collective_rpc("rlhf_moe_kernels")[0] == {"tiled": 2}
    engine.update_weights(_hf(m1), version=4)  # the module's model again, for the tests after this one
    assert torch.equal(torch.tensor(engine.sequence_logprobs(seqs.tolist())), fresh)


def test_expert_parallel_engine_serves_each_expert_once(setup, tmp_path):
    """tp2 x ep2: each worker's layers hold half the experts, the router's global ids mapped to its own and the
    other rank's slots weighted 0 (actors/vllm/worker_ext.py); the kernel skips those, the all-reduce adds the two
    shares. A rank that also summed the other's slots (on its own expert 0) would be off by whole units."""
    engine, m1, _, seqs, _ = setup
    d = tmp_path / "w"
    save_tokenizer(build_tokenizer(m1.config.vocab_size), d)
    save_pretrained(m1, d)
    one = torch.tensor(engine.sequence_logprobs(seqs.tolist()))
    ep = _engine(d, "tiled", tp=2, ep=2)
    try:
        assert ep.llm.collective_rpc("rlhf_moe_kernels") == [{"tiled": 2}] * 2
        two = torch.tensor(ep.sequence_logprobs(seqs.tolist()))
    finally:
        ep.close()
    assert (two - one).abs().median() <= 0.03 and (two - one).abs().mean() <= 0.04
