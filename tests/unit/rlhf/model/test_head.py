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


@pytest.mark.parametrize("chunk", [5, 1024])
def test_under_autocast_the_matmuls_are_bf16_and_the_rest_fp32(chunk):
    """trainer.compute_dtype=bfloat16: the head's matmuls (forward and backward) take bf16 operands, the
    softmax, the sums and the weight's gradient stay fp32: the same as autograd through bf16 logits cast to
    fp32, and visibly not the fp32 computation."""
    g = torch.Generator().manual_seed(2)
    B, T, H, V = 2, 11, 32, 300
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    g_logp, g_ent = torch.randn(B, T - 1, generator=g), torch.randn(B, T - 1, generator=g)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_logp, ref_ent = token_logprobs((h1.bfloat16() @ w1.bfloat16().T).float(), ids)
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent = head_logprobs(h2[:, :-1], w2, ids[:, 1:], chunk=chunk)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    assert logp.dtype == ent.dtype == h2.grad.dtype == w2.grad.dtype == torch.float32

    assert torch.allclose(logp, ref_logp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.allclose(h2.grad, h1.grad, atol=1e-6)
    # the weight's gradient: one bf16 matmul per chunk, summed in fp32 (autograd's is one bf16 matmul over all
    # tokens): equal with one chunk, within bf16 rounding of it with several
    w_err = ((w2.grad - w1.grad).abs().max() / w1.grad.abs().max()).item()
    assert w_err <= (1e-6 if chunk >= B * (T - 1) else 1e-2), w_err
    fp32_logp, _ = token_logprobs(hidden @ weight.T, ids)
    assert (logp - fp32_logp).abs().max() > 1e-3  # bf16 rounding shows: the matmuls did run in bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(monkeypatch, dtype):
    """The update keeps the forward's logits for the backward (up to KEEP_LOGITS_BYTES) instead of recomputing
    them: the same values, so the same gradients to the bit; a second backward (retain_graph) recomputes."""
    import rlhf.model.head as head

    g = torch.Generator().manual_seed(3)
    B, T, H, V = 2, 13, 32, 300
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    g_logp, g_ent = torch.randn(B, T - 1, generator=g), torch.randn(B, T - 1, generator=g)

    def grads(keep_bytes, twice=False):
        monkeypatch.setattr(head, "KEEP_LOGITS_BYTES", keep_bytes)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not torch.float32):
            logp, ent = head_logprobs(h[:, :-1], w, ids[:, 1:], chunk=5)
        loss = (logp * g_logp).sum() + (ent * g_ent).sum()
        loss.backward(retain_graph=twice)
        first = (h.grad.clone(), w.grad.clone())
        if twice:
            h.grad, w.grad = None, None
            loss.backward()
            assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])
        return first

    kept, recomputed = grads(2**30, twice=True), grads(0)
    assert all(torch.equal(a, b) for a, b in zip(kept, recomputed))


@pytest.mark.parametrize("chunk", [4, 1024])
def test_a_gradient_buffer_gets_the_weight_gradient_added_in_place(chunk):
    """A weight whose fp32 gradient buffer is already there (the trainer's, zeroed before a step) gets each
    micro-batch's gradient added into it in place: the same sums as autograd's returned-then-accumulated
    gradient, bit for bit into zeros and with one chunk, to fp32 rounding over several chunks."""
    g = torch.Generator().manual_seed(4)
    B, T, H, V = 2, 6, 8, 40
    weight = torch.randn(V, H, generator=g)
    batches = [(torch.randn(B, T, H, generator=g), torch.randint(0, V, (B, T), generator=g)) for _ in range(3)]
    plain = weight.clone().requires_grad_()
    fused = weight.clone().requires_grad_()
    fused.grad = torch.zeros_like(fused)
    buffer = fused.grad
    for i, (hidden, ids) in enumerate(batches):
        for w in (plain, fused):
            logp, ent = head_logprobs(hidden, w, ids, chunk=chunk)
            (logp.sum() + 0.1 * ent.sum()).backward()
        assert fused.grad is buffer  # the same storage throughout
        if i == 0 or chunk >= B * T:
            assert torch.equal(fused.grad, plain.grad)
        else:
            assert torch.allclose(fused.grad, plain.grad, atol=1e-6)


def test_the_embedding_adds_token_rows_into_its_gradient_buffer():
    from rlhf.model.layers import Embedding

    g = torch.Generator().manual_seed(5)
    ref, emb = torch.nn.Embedding(30, 4), Embedding(30, 4)
    emb.load_state_dict(ref.state_dict())
    emb.weight.grad = torch.zeros_like(emb.weight)
    buffer = emb.weight.grad
    for i in range(3):
        ids = torch.randint(0, 30, (3, 7), generator=g)
        ids[0, :3] = 5  # a repeated token
        up = torch.randn(3, 7, 4, generator=g)
        (ref(ids) * up).sum().backward()
        (emb(ids) * up).sum().backward()
        assert emb.weight.grad is buffer
        assert torch.equal(emb.weight.grad, ref.weight.grad) if i == 0 else \
            torch.allclose(emb.weight.grad, ref.weight.grad, atol=1e-6)
    # without a buffer (a first backward, or a gathered ZeRO-3 weight) autograd's own gradient
    plain = Embedding(30, 4)
    plain.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 30, (2, 5), generator=g)
    plain(ids).sum().backward()
    ref.weight.grad = None
    ref(ids).sum().backward()
    assert torch.equal(plain.weight.grad, ref.weight.grad)


@pytest.fixture(scope="module")
def compiled_kernels():
    from rlhf.model.head import RowKernels

    kernels = RowKernels()
    return kernels


@pytest.mark.parametrize("temperature,entropy_grad", [(None, True), (0.7, False)])
def test_the_compiled_row_kernels_equal_the_eager_ones(compiled_kernels, temperature, entropy_grad):
    """The head's row kernels compiled by torch.compile (what a large vocabulary on cpu runs) compute what the
    eager ones do: forward within fp32 rounding (their exp is inductor's vectorised one, their entropy sums in one
    pass), dL/dz written over the bf16 logits within one bf16 rounding, the target's column included."""
    from rlhf.model.head import rows_backward, rows_forward

    g = torch.Generator().manual_seed(7)
    R, V = 64, 300
    z = (torch.randn(R, V, generator=g) * 3).bfloat16()
    targets = torch.randint(0, V, (R,), generator=g)
    t = None if temperature is None else torch.tensor(temperature)
    eager = rows_forward(z, targets, t)
    compiled = compiled_kernels.forward(z, targets, t)
    assert compiled_kernels.compiled, "torch.compile failed: the eager kernels ran"
    for a, b in zip(eager[:2], compiled[:2]):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-5), (a - b).abs().max()
    # the entropy lse - sum(p z) cancels (lse about 12 here, the sum about 10), and the compiled kernel sums
    # exp(z - max) z / sum exp(z - max) in one pass where the eager one sums exp(z - lse) z: fp32 rounding apart
    assert torch.allclose(eager[2], compiled[2], rtol=1e-5, atol=1e-4), (eager[2] - compiled[2]).abs().max()
    lse, _, ent = eager
    g_logp = torch.randn(R, generator=g)
    g_ent = torch.randn(R, generator=g) if entropy_grad else None
    block = torch.zeros(2 * R, V, dtype=torch.bfloat16)  # a view of a larger buffer, as the head's chunks are
    eager_dz, block[R:] = z.clone(), z
    rows_backward(eager_dz, targets, lse, ent, g_logp, g_ent, t)
    compiled_kernels.backward(block[R:], targets, lse, ent, g_logp, g_ent, t)
    assert torch.equal(block[:R], torch.zeros(R, V, dtype=torch.bfloat16))
    assert torch.allclose(block[R:].float(), eager_dz.float(), rtol=2 ** -7, atol=1e-6)


def test_a_compile_that_fails_falls_back_to_the_eager_kernels(monkeypatch, caplog):
    import rlhf.model.head as head

    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    kernels = head.RowKernels()
    g = torch.Generator().manual_seed(8)
    z, targets = torch.randn(4, 9, generator=g), torch.randint(0, 9, (4,), generator=g)
    with caplog.at_level("WARNING", logger="rlhf.model.layers"):
        out = kernels.forward(z, targets, None)
        again = kernels.forward(z, targets, None)
    assert kernels.compiled is False
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(out, again, head.rows_forward(z, targets, None)))
    assert [r.getMessage() for r in caplog.records if "could not be compiled" in r.getMessage()] and \
        len(caplog.records) == 1 and "no working C++ compiler" in caplog.records[0].getMessage()


def test_the_head_on_compiled_kernels_gives_the_eager_heads_values_and_gradients(monkeypatch, compiled_kernels):
    """The whole fused head (chunks, kept logits, the weight's gradient buffer) with the compiled kernels, as the
    small model's 32,000-token vocabulary runs it, against the same head in eager torch, bf16 under autocast."""
    import rlhf.model.head as head

    g = torch.Generator().manual_seed(9)
    B, T, H, V = 2, 40, 32, 300
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    g_logp, g_ent = torch.randn(B, T - 1, generator=g), torch.randn(B, T - 1, generator=g)

    def run(min_vocab):
        monkeypatch.setattr(head, "COMPILE_MIN_VOCAB", min_vocab)
        monkeypatch.setattr(head, "COMPILED", compiled_kernels)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, ent = head.head_logprobs(h[:, :-1], w, ids[:, 1:], chunk=50)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        return logp, ent, h.grad, w.grad

    eager, compiled = run(10 ** 9), run(0)
    assert compiled_kernels.compiled
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-4), (a - b).abs().max()
    assert torch.allclose(eager[0], compiled[0], atol=1e-5)
