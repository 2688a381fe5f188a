"""trainer.compute_dtype=bfloat16 (autocast over fp32 parameters): matmuls in bf16, the routers' expert choice
and every gradient in fp32, logprobs within bf16 rounding of the fp32 model's. Both architectures."""

import pytest
import torch

from rlhf.model.qwen3_moe import Experts, Qwen3MoeForCausalLM, Router
from rlhf.moe.routing import Routing
from rlhf.schema import Architecture, Attention, MLAConfig, ModelConfig, RouterScoring

QWEN = ModelConfig(vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
                   first_k_dense_layers=1, rope_theta=10000.0)
PANGU = ModelConfig(vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=16, architecture=Architecture.pangu_moe, attention=Attention.mla,
                    mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                    router_scoring=RouterScoring.sigmoid, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                    shared_expert_intermediate_size=32, first_k_dense_layers=1, intermediate_size=48, rope_theta=10000.0)
BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def test_the_router_chooses_in_fp32_under_autocast():
    router = Router(QWEN)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(200, QWEN.hidden_size, generator=torch.Generator().manual_seed(0))
    want = router(x)
    with torch.autocast(**BF16):
        got = router(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # bf16 logits would flip near-tied choices


def experts_and_rows(seed: int, n: int):
    """Random experts of QWEN's shape, n rows and the expert each row is routed to."""
    experts = Experts(QWEN)
    g = torch.Generator().manual_seed(seed)
    for p in experts.parameters():
        p.data.normal_(0, 0.2, generator=g)
    x = torch.randn(n, QWEN.hidden_size, generator=g)
    return experts, x, torch.randint(0, QWEN.num_experts, (n,), generator=g)


def test_experts_cast_their_stacks_once_and_compute_in_bf16():
    experts, x, chosen = experts_and_rows(1, 40)
    with torch.autocast(**BF16):
        y = experts.forward_rows(x, chosen)
    # silu(gate) * up in fp32 from the bf16 projections, rounded to bf16 once (`rlhf.model.experts.swiglu`)
    ref = torch.stack([torch.nn.functional.linear(
        (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16(), experts.down_proj[e].bfloat16())
        for e, (gate, up) in ((int(e), torch.nn.functional.linear(x[r:r + 1].bfloat16(), experts.gate_up_proj[int(e)]
                                                                   .bfloat16()).chunk(2, -1))
                              for r, e in enumerate(chosen))]).squeeze(1)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    y.float().square().sum().backward()
    assert experts.gate_up_proj.grad.dtype == experts.down_proj.grad.dtype == torch.float32


@pytest.mark.parametrize("cfg", [QWEN, PANGU], ids=["qwen3_moe", "pangu_moe"])
def test_logprobs_within_bf16_rounding_and_fp32_gradients(cfg):
    """The same experts forced on both sides (the fp32 forward's choice, replayed), so that what differs is bf16
    rounding alone: a near-tie that the rounding tips to another expert moves a token by far more (the
    trainer/engine mismatch routing replay addresses, docs/routing_replay.md)."""
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=3, std=0.05)
    B, T = 3, 17
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(2))

    def logprobs(routing):
        return model.lm_head(model.hidden_states(ids, routing=routing)[:, :-1], ids[:, 1:], 1.0)

    record = Routing(record=True)
    lp32, ent32 = logprobs(record)
    (lp32.sum() + ent32.sum()).backward()
    g32 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_layers
    forced = record.chosen_BTLk(B, T, moe_layers, cfg.num_experts_per_tok)
    with torch.autocast(**BF16):
        lp16, ent16 = logprobs(Routing(forced_BTLk=forced))
    (lp16.sum() + ent16.sum()).backward()
    assert lp16.dtype == ent16.dtype == torch.float32
    diff = (lp16 - lp32).abs()
    assert 1e-4 < diff.max() < 2e-2, diff.max()  # bf16's 8-bit mantissa over the matmuls: there, and small
    assert set(g32) == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in g32:
            assert p.grad.dtype == torch.float32, n
            rel = ((p.grad - g32[n]).norm() / g32[n].norm()).item()
            assert rel < 0.05, (n, rel)


@pytest.mark.parametrize("heads, kv_heads, d, dv, scale", [(4, 2, 16, 16, None), (3, 3, 24, 16, 0.3)])
def test_short_bf16_training_attention_equals_fp32_attention_within_bf16_rounding(heads, kv_heads, d, dv, scale):
    """`rlhf.model.layers.attention`: under bf16 autocast with autograd recording, sequences up to SHORT_SEQUENCE
    take `_ShortAttention` (FlashAttention-2's numerics); its output and the gradients of q, k and v equal SDPA in
    fp32 of the same bf16 inputs within bf16 rounding (relative error below 1e-2, each within 3 of its bf16 steps),
    for grouped heads (GQA), MLA's shapes (v narrower than q and k, a given scale) and a left-padded row that sees
    only itself. Inference forwards and fp32 keep SDPA's default kernel."""
    from rlhf.model.layers import attention

    g = torch.Generator().manual_seed(4)
    B, T = 3, 24
    q, k = (torch.randn(B, n, T, d, generator=g).bfloat16() for n in (heads, kv_heads))
    v = torch.randn(B, kv_heads, T, dv, generator=g).bfloat16()
    grad_out = torch.randn(B, heads, T, dv, generator=g).bfloat16()
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T).clone()
    mask[0, :, :, :3] = torch.eye(T, dtype=torch.bool)[:, :3]  # a left-padded row
    gqa = heads != kv_heads

    def fp32_sdpa(*args):
        return torch.nn.functional.scaled_dot_product_attention(*(x.float() for x in args), attn_mask=mask,
                                                                scale=scale, enable_gqa=gqa)

    with torch.autocast(**BF16):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        got = attention(qg, kg, vg, mask, scale=scale, enable_gqa=gqa)
        inference = attention(q, k, v, mask, scale=scale, enable_gqa=gqa)  # no grad recorded: the default kernel
        default = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                   enable_gqa=gqa)
        assert torch.equal(inference, default)
    got.backward(grad_out)
    q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
    want = fp32_sdpa(q32, k32, v32)
    want.backward(grad_out.float())
    assert got.dtype == torch.bfloat16
    for ours, ref in ((got, want), (qg.grad, q32.grad), (kg.grad, k32.grad), (vg.grad, v32.grad)):
        assert ours.dtype == torch.bfloat16 and ours.shape == ref.shape
        err = (ours.float() - ref.detach()).abs()
        assert (err.norm() / ref.norm()).item() < 1e-2
        assert (err <= 3 * 2.0 ** -8 * ref.detach().abs().max()).all()
    q32 = q.float()
    assert torch.equal(attention(q32, k.float(), v.float(), mask, scale=scale, enable_gqa=gqa),
                       fp32_sdpa(q, k, v))  # fp32: SDPA's default


def test_bf16_expert_rows_padded_on_cpu_give_the_same_values_and_gradients(monkeypatch):
    """`EXPERT_ROWS_MULTIPLE`: under bf16 autocast on cpu every expert's group of rows in the grouped multiply is a
    multiple of it (zero rows appended, their outputs dropped); outputs and gradients as without the padding, within
    bf16 rounding of the weight gradients' sums (the rows are the reduction there). fp32 is not padded."""
    import rlhf.model.qwen3_moe as q

    experts, x, chosen = experts_and_rows(2, 150)
    groups, grouped_mm = [], torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        groups.append(torch.diff(offs, prepend=offs.new_zeros(1)).tolist())
        return grouped_mm(a, b, offs=offs, **kw)

    def run(multiple, autocast=True):
        monkeypatch.setattr(q, "EXPERT_ROWS_MULTIPLE", multiple)
        groups.clear()
        experts.zero_grad()
        xx = x.clone().requires_grad_()
        with torch.autocast(**BF16, enabled=autocast):
            y = experts.forward_rows(xx, chosen)
        y.float().square().sum().backward()
        return [y.float(), xx.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()], \
            [n for g in groups for n in g]

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    padded, padded_rows = run(64)
    plain, plain_rows = run(1)
    assert padded_rows and all(n % 64 == 0 for n in padded_rows) and any(n % 64 for n in plain_rows)
    assert torch.equal(padded[0], plain[0])  # each row's output: the same dot products
    for a, b in zip(padded[1:], plain[1:]):
        assert torch.allclose(a, b, rtol=1e-2, atol=1e-4), (a - b).abs().max()
    _, fp32_rows = run(64, autocast=False)
    assert fp32_rows == plain_rows  # fp32 goes to BLAS: no padding


def test_a_steps_casts_kept_give_the_same_gradients_as_casting_every_micro_batch():
    """`casts_kept` around a step's micro-batches (autocast entered once, backward under `autocast_off`): each weight
    is cast once for the step and the gradients are bit for bit those of autocast entered for each forward."""
    from rlhf.model.layers import autocast_off, casts_kept

    model = Qwen3MoeForCausalLM(QWEN)
    model.init_weights(seed=5, std=0.05)
    g = torch.Generator().manual_seed(6)
    batches = [torch.randint(3, QWEN.vocab_size, (2, 9), generator=g) for _ in range(3)]

    def loss(ids):
        lp, ent = model.lm_head(model.hidden_states(ids)[:, :-1], ids[:, 1:], 1.0)
        return -(lp.sum() + 0.1 * ent.sum())

    def grads():
        out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        return out

    for ids in batches:
        with torch.autocast(**BF16):
            l = loss(ids)
        l.backward()
    each = grads()
    casts = []
    to = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: casts.append((self.shape, self.dtype)) or to(self, *a, **k)
    try:
        with casts_kept("cpu", torch.bfloat16):
            for ids in batches:
                l = loss(ids)
                with autocast_off("cpu"):
                    l.backward()
    finally:
        torch.Tensor.to = to
    once = grads()
    assert each.keys() == once.keys()
    assert all(torch.equal(each[n], once[n]) for n in each), [n for n in each if not torch.equal(each[n], once[n])]
    stacks = [s for s, dtype in casts if s == model.model.layers[1].mlp.experts.gate_up_proj.shape
              and dtype is torch.float32]  # (the first backward's bf16 gradients are cast back to fp32 too)
    assert len(stacks) == QWEN.num_hidden_layers - QWEN.first_k_dense_layers  # once per layer, not per micro-batch


def test_cast_once_hands_out_one_copy_until_the_scope_closes_or_the_parameter_changes():
    from rlhf.model.layers import cast_once, casts_kept

    p = torch.nn.Parameter(torch.randn(4, 3))
    assert cast_once(p, torch.bfloat16) is not cast_once(p, torch.bfloat16)  # no scope: a cast per call
    with casts_kept("cpu", torch.bfloat16):
        a = cast_once(p, torch.bfloat16)
        assert cast_once(p, torch.bfloat16) is a and cast_once(p, torch.float32) is p
        (a.float().sum() + cast_once(p, torch.bfloat16).float().sum()).backward()
        assert torch.equal(p.grad, torch.full_like(p, 2.0))  # both uses reach the parameter
        with torch.no_grad():
            p.add_(1.0)
        b = cast_once(p, torch.bfloat16)
        assert b is not a and torch.equal(b, (p + 0).bfloat16())
    assert cast_once(p, torch.bfloat16) is not b
    with casts_kept("cpu", None):  # fp32 compute: no autocast, nothing kept
        assert not torch.is_autocast_enabled("cpu") and cast_once(p, torch.bfloat16) is not cast_once(p, torch.bfloat16)


def test_a_cast_once_weight_adds_each_micro_batchs_gradient_into_its_buffer_in_place(monkeypatch):
    """A weight cast once per step whose fp32 gradient buffer is there (the trainer's, zeroed before a step) gets
    each micro-batch's bf16 gradient cast and added into that buffer block by block: the same storage throughout
    and the sums autograd's cast-and-accumulate gives, bit for bit; with no buffer yet, autograd's gradient."""
    import rlhf.model.layers as layers

    monkeypatch.setattr(layers, "ADD_BLOCK", 7)  # several blocks of rows over a [3, 5, 4] stack
    added = []
    add_into = layers.add_into
    monkeypatch.setattr(layers, "add_into", lambda into, grad: added.append(grad.dtype) or add_into(into, grad))
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(6, 4, generator=g) for _ in range(3)]
    plain, fused = torch.nn.Parameter(torch.randn(3, 5, 4, generator=g)), None
    fused = torch.nn.Parameter(plain.detach().clone())
    for x in xs:
        (plain.bfloat16() @ x.bfloat16().T).float().pow(2).sum().backward()
    with layers.casts_kept("cpu", torch.bfloat16):
        w = layers.cast_once(fused, torch.bfloat16)
        for i, x in enumerate(xs):
            with layers.autocast_off("cpu"):
                (w @ x.bfloat16().T).float().pow(2).sum().backward()
            if i == 0:
                buffer = fused.grad  # the first backward: no buffer yet, autograd's own gradient
    assert fused.grad is buffer and torch.equal(fused.grad, plain.grad)
    assert added == [torch.bfloat16] * 2  # the second and third micro-batches: no fp32 copy of the gradient


def test_the_residual_stream_is_bf16_under_autocast_and_the_parameters_stay_fp32():
    """`trainer.compute_dtype=bfloat16`: hidden states are bf16 from the embedding on (norms scale in bf16), as a
    bf16 model's; without autocast they keep the parameters' dtype; the parameters and their gradients are fp32."""
    from rlhf.model.layers import RMSNorm, residual

    model = Qwen3MoeForCausalLM(QWEN)
    model.init_weights(seed=1, std=0.05)
    ids = torch.randint(3, QWEN.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert model.hidden_states(ids).dtype == torch.float32
    with torch.autocast(**BF16):
        h = model.hidden_states(ids)
        x = torch.randn(4, 8)
        assert residual(x).dtype == torch.bfloat16 and residual(x.bfloat16()).dtype == torch.bfloat16
    assert h.dtype == torch.bfloat16 and residual(x) is x
    h.float().sum().backward()
    assert all(p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
               for p in model.parameters())
    norm = RMSNorm(8, 1e-6)
    x16 = x.bfloat16()
    y = norm(x16)
    x32 = x16.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()  # weight 1: fp32 norm, rounded
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)


def test_scratch_buffers_are_reused_and_released():
    """The head's large buffers (`rlhf.model.layers.Scratch`): a buffer handed back serves the next request that
    fits, as a contiguous tensor of the asked shape; at most `keep` are held; `release` drops them."""
    from rlhf.model.layers import Scratch

    s = Scratch(keep=2)
    cpu = torch.device("cpu")
    a = s.take((4, 6), torch.bfloat16, cpu)
    assert a.shape == (4, 6) and a.is_contiguous()
    ptr = a.data_ptr()
    s.give(a)
    s.give(a)  # twice: held once
    b = s.take((3, 5), torch.bfloat16, cpu)  # smaller: the same memory
    assert b.shape == (3, 5) and b.is_contiguous() and b.data_ptr() == ptr
    assert s.take((3, 5), torch.bfloat16, cpu).data_ptr() != ptr  # in use: a new one
    assert s.take((4, 6), torch.float32, cpu).dtype == torch.float32  # another dtype never shares
    s.give(b)
    held = [s.take((n,), torch.bfloat16, cpu) for n in (20, 30, 40)]  # the first reuses b's 24
    for t in held:
        s.give(t)
    assert sorted(t.numel() for t in s.free) == [30, 40]  # the largest `keep`
    s.release()
    assert s.free == []


def test_the_weight_transposed_once_per_step():
    from rlhf.model.layers import casts_kept, transposed_once

    p = torch.nn.Parameter(torch.randn(5, 3))
    view = transposed_once(p, torch.float32)
    assert view.shape == (3, 5) and not view.is_contiguous()  # no scope: the transposed view, no copy
    with casts_kept("cpu", torch.bfloat16):
        t = transposed_once(p, torch.bfloat16)
        assert t.is_contiguous() and torch.equal(t, p.detach().bfloat16().T) and not t.requires_grad
        assert transposed_once(p, torch.bfloat16) is t
        with torch.no_grad():
            p.mul_(2)
        assert transposed_once(p, torch.bfloat16) is not t  # the parameter changed: cast again


@pytest.mark.parametrize("heads, kv_heads, gqa", [(3, 2, True), (4, 2, False)])
def test_short_bf16_attention_refuses_heads_that_do_not_group_as_sdpa_does(heads, kv_heads, gqa):
    """Query heads that are not a multiple of the KV heads, or fewer KV heads without `enable_gqa`: SDPA's own
    error, not a silent grouping."""
    from rlhf.model.layers import attention

    T = 8
    q = torch.randn(1, heads, T, 16).bfloat16().requires_grad_()
    k, v = (torch.randn(1, kv_heads, T, 16).bfloat16() for _ in range(2))
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.autocast(**BF16), pytest.raises(RuntimeError):
        attention(q, k, v, mask, enable_gqa=gqa)
