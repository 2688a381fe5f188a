"""The trainer's fused elementwise kernels in bf16: RMSNorm (`rlhf.model.layers._LowPrecisionNorm`) and the experts'
SwiGLU (`rlhf.model.experts._LowPrecisionSwiGLU`). Their eager functions against autograd of the same maths in
fp32 (within bf16 rounding), the forward values against the eager ops they replace (the norm's bit for bit), the
compiled kernels (what large inputs on cpu run) against the eager ones, and fp32 left on the eager ops."""

import pytest
import torch
import torch.nn.functional as F

import rlhf.model.experts as experts
import rlhf.model.layers as layers
from rlhf.model.layers import CompiledKernels, RMSNorm, casts_kept

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def norm_kernels():
    return CompiledKernels("the RMSNorm kernels", layers.norm_forward, layers.norm_backward)


@pytest.fixture(scope="module")
def swiglu_kernels():
    return CompiledKernels("the experts' SwiGLU kernels", experts.swiglu_forward, experts.swiglu_backward)


def norm_inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    weight = torch.randn(shape[-1], generator=g) * 0.5 + 1
    return x, weight, torch.randn(shape, generator=g).bfloat16()


@pytest.mark.parametrize("shape", [(3, 7, 48), (2, 5, 4, 16)], ids=["hidden", "per_head"])
def test_the_bf16_norm_computes_the_eager_norms_values_and_fp32_gradients(shape):
    """Under autocast, a bf16 activation through RMSNorm: the forward bit for bit what the eager ops gave (fp32
    normalising, one rounding, the weight cast once), the input's gradient within bf16 rounding of fp32 autograd of
    the same maths, the weight's gradient in fp32 (summed in fp32: closer to fp32 autograd than bf16 rounding),
    accumulated over calls as autograd does."""
    x, weight, g = norm_inputs(shape)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data.copy_(weight)
    xb = x.clone().requires_grad_()
    with torch.autocast(**BF16), casts_kept("cpu", torch.bfloat16):
        y = norm(xb)
        y2 = norm(xb)
    x32 = x.float()
    eager = weight.bfloat16() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, eager) and torch.equal(y2, eager)
    (y.float() * g.float()).sum().backward()
    gx_once, gw_once = xb.grad.clone(), norm.weight.grad.clone()
    (y2.float() * g.float()).sum().backward()

    xr, wr = x.float().requires_grad_(), weight.clone().requires_grad_()
    (wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()).sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32
    assert rel(gx_once, xr.grad) < 1e-2 and rel(gw_once, wr.grad) < 1e-2
    assert torch.equal(norm.weight.grad, gw_once * 2) and torch.equal(xb.grad, gx_once * 2)


def test_an_fp32_norm_keeps_the_eager_ops_values_and_gradients():
    x, weight, g = norm_inputs((4, 6, 32), seed=1)
    x = x.float()
    norm = RMSNorm(32, 1e-6)
    norm.weight.data.copy_(weight)
    a = x.clone().requires_grad_()
    (norm(a) * g.float()).sum().backward()
    b, wb = x.clone().requires_grad_(), weight.clone().requires_grad_()
    (wb * (b * torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + 1e-6)) * g.float()).sum().backward()
    assert torch.equal(a.grad, b.grad) and torch.equal(norm.weight.grad, wb.grad)


def test_the_compiled_norm_kernels_equal_the_eager_ones(norm_kernels):
    """The compiled kernels (a cpu input of NORM_COMPILE_MIN_ELEMENTS or more) against the eager functions: the
    normaliser within fp32 rounding, outputs within bf16 rounding (inductor's rsqrt and sums are its own, and it
    rounds to bf16 only where a value leaves the kernel)."""
    x, weight, g = norm_inputs((300, 64), seed=2)
    w = weight.bfloat16()
    y, r = layers.norm_forward(x, w, 1e-6)
    yc, rc = norm_kernels.forward(x, w, 1e-6)
    assert norm_kernels.compiled, "torch.compile failed: the eager kernels ran"
    assert torch.allclose(rc, r, rtol=1e-5) and torch.allclose(yc.float(), y.float(), rtol=2 ** -7, atol=1e-6)
    gx, gw = layers.norm_backward(g, x, r, w)
    gxc, gwc = norm_kernels.backward(g, x, r, w)
    assert gxc.dtype == torch.bfloat16 and gwc.dtype == torch.float32
    # dL/dx is a difference of two terms, rounded to bf16 after it: an ulp or two of the largest apart
    assert rel(gxc, gx) < 4e-3 and (gxc.float() - gx.float()).abs().max() <= 2 ** -6 * gx.float().abs().max()
    # inductor fuses n = (x r) into the product without rounding it to bf16 between: the weight's gradient sums
    # fp32 n where the eager function sums bf16 n
    assert rel(gwc, gw) < 4e-3


def swiglu_rows(P=256, I=48, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(P, 2 * I, generator=g) * 2).bfloat16(), torch.randn(P, I, generator=g).bfloat16()


def test_the_bf16_swiglu_is_the_fp32_maths_rounded_once():
    """silu(gate) * up of bf16 rows: the product of fp32 silu and up rounded to bf16 once (the eager ops rounded
    silu's output first), its gradient within bf16 rounding of fp32 autograd; padding rows (zeros) get zeros."""
    gu, g = swiglu_rows()
    gu[-5:] = 0
    a = gu.clone().requires_grad_()
    y = experts.swiglu(a)
    gate, up = gu.float().chunk(2, dim=-1)
    assert y.dtype == torch.bfloat16 and torch.equal(y, (F.silu(gate) * up).bfloat16())
    y.backward(g)
    r = gu.float().requires_grad_()
    gate, up = r.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(g.float())
    assert a.grad.dtype == torch.bfloat16 and rel(a.grad, r.grad) < 1e-2
    assert not a.grad[-5:].any()
    # against autograd of the eager bf16 ops the rows differ by the roundings alone
    b = gu.clone().requires_grad_()
    gate, up = b.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(g)
    assert rel(a.grad, b.grad) < 1e-2


def test_an_fp32_swiglu_keeps_the_eager_ops():
    gu, g = swiglu_rows(seed=4)
    a, b = gu.float().requires_grad_(), gu.float().requires_grad_()
    y = experts.swiglu(a)
    gate, up = b.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    assert torch.equal(y, ref)
    y.backward(g.float())
    ref.backward(g.float())
    assert torch.equal(a.grad, b.grad)


def test_the_compiled_swiglu_kernels_equal_the_eager_ones(swiglu_kernels):
    gu, g = swiglu_rows(seed=5)
    y = experts.swiglu_forward(gu)
    yc = swiglu_kernels.forward(gu)
    assert swiglu_kernels.compiled, "torch.compile failed: the eager kernels ran"
    assert torch.allclose(yc.float(), y.float(), rtol=2 ** -7, atol=1e-6)
    d, dc = experts.swiglu_backward(g, gu), swiglu_kernels.backward(g, gu)
    assert dc.shape == gu.shape and dc.dtype == torch.bfloat16
    assert torch.allclose(dc.float(), d.float(), rtol=2 ** -7, atol=1e-6)


def test_a_bf16_model_on_the_compiled_kernels_gives_the_eager_kernels_values_and_gradients(
        monkeypatch, norm_kernels, swiglu_kernels):
    """The small model's shapes take the compiled kernels; a tiny Qwen3-MoE forced onto them (thresholds 0) against
    the same model on the eager ones, bf16 under autocast: logprobs and every gradient within bf16 rounding."""
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
    from rlhf.schema import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=5, std=0.05)
    ids = torch.randint(3, cfg.vocab_size, (3, 20), generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(layers, "NORM_KERNELS", norm_kernels)
    monkeypatch.setattr(experts, "SWIGLU_KERNELS", swiglu_kernels)

    def run(min_elements):
        monkeypatch.setattr(layers, "NORM_COMPILE_MIN_ELEMENTS", min_elements)
        monkeypatch.setattr(experts, "SWIGLU_COMPILE_MIN_ELEMENTS", min_elements)
        model.zero_grad()
        with torch.autocast(**BF16), casts_kept("cpu", torch.bfloat16):
            logp, ent = model.lm_head(model.hidden_states(ids)[:, :-1], ids[:, 1:], 1.0)
        (logp.sum() + ent.sum()).backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager, compiled = run(10 ** 9), run(0)
    assert norm_kernels.compiled and swiglu_kernels.compiled
    assert (eager[0] - compiled[0]).abs().max() < 5e-2
    assert eager[1].keys() == compiled[1].keys() and len(eager[1]) == len(list(model.parameters()))
    for name, grad in eager[1].items():
        assert rel(compiled[1][name], grad) < 3e-2, name
