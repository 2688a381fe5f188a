"""The fused, chunked LM-head logprobs and entropies equal the plain computation (logits, log-softmax,
gather, -sum p log p) in value and gradient, for any chunking and temperature."""

import pytest
import torch

from rlhf.model.head import head_logprobs
from rlhf.parallel.trainer import token_logprobs


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 1024), (1.3, 1)])
def test_fused_head_equals_logits_then_log_softmax(temperature, chunk):
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 9, 16, 50
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    g_logp, g_ent = torch.randn(B, T - 1, generator=g), torch.randn(B, T - 1, generator=g)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_logp, ref_ent = token_logprobs(h1 @ w1.T, ids, temperature)
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = head_logprobs(h2[:, :-1], w2, ids[:, 1:], temperature, chunk)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()

    assert logp.dtype == torch.float32 and logp.shape == (B, T - 1)
    assert torch.allclose(logp, ref_logp.float(), atol=1e-6) and torch.allclose(ent, ref_ent.float(), atol=1e-6)
    # both compute in fp32 inside, in other orders: gradients agree to fp32 rounding
    assert torch.allclose(h2.grad, h1.grad, atol=1e-5) and torch.allclose(w2.grad, w1.grad, atol=1e-5)


def test_one_output_alone_gets_its_own_gradient():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    weight = torch.randn(11, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5), generator=g)
    logp, _ = head_logprobs(hidden, weight, ids, chunk=3)
    logp.sum().backward()
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None]).sum().backward()
    assert torch.allclose(hidden.grad, h.grad, atol=1e-5) and torch.allclose(weight.grad, w.grad, atol=1e-5)
