"""Grouped-GEMM experts (`rlhf.model.experts.grouped_swiglu`) equal the per-expert loop, values and gradients: fp32
within 1e-6 (relative and absolute; 1e-5 where padding gives a group another row count than the loop's, and BLAS
sums in another order), bf16 within bf16 rounding; for empty experts, one row, uneven counts, padded groups, an EP
rank's part of the stack and replayed routes. `Experts.forward_rows` takes the grouped path on cpu."""

import pytest
import torch

from rlhf.model.experts import GroupedRows, grouped_mm_supported, grouped_swiglu, looped_swiglu
from rlhf.model.qwen3_moe import Experts, Qwen3MoeForCausalLM
from rlhf.moe.routing import Routing
from rlhf.schema import ModelConfig

H, I = 64, 32


def stacks(E: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.2).requires_grad_(), \
        (torch.randn(E, H, I, generator=g) * 0.2).requires_grad_()


def values_and_grads(fn, x, expert_R, gate_up, down, dtype=torch.float32, multiple=1):
    for t in (x, gate_up, down):
        t.grad = None
    y = fn(x, expert_R, gate_up.to(dtype), down.to(dtype), multiple)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.float(), x.grad.clone(), gate_up.grad.clone(), down.grad.clone()]


ROUTES = {
    "uneven": lambda g: torch.randint(0, 8, (300,), generator=g) ** 2 % 8,  # experts 2, 3, 5, 6, 7 empty
    "one_row": lambda g: torch.tensor([5]),
    "all_one_expert": lambda g: torch.full((70,), 3),
    "uniform": lambda g: torch.randint(0, 8, (257,), generator=g),
}


@pytest.mark.parametrize("multiple", [1, 64])
@pytest.mark.parametrize("route", list(ROUTES))
def test_grouped_equals_the_loop_in_fp32(route, multiple):
    g = torch.Generator().manual_seed(1)
    expert_R = ROUTES[route](g)
    x = torch.randn(len(expert_R), H, generator=g).requires_grad_()
    gate_up, down = stacks(8)
    want = values_and_grads(looped_swiglu, x, expert_R, gate_up, down)
    got = values_and_grads(grouped_swiglu, x, expert_R, gate_up, down, multiple=multiple)
    tol = 1e-6 if multiple == 1 else 1e-5  # padded: one row against a group of 64, BLAS's gemv against its gemm
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max()
    if multiple == 1:  # per row, the same matmul shapes: the same dot products
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("route", list(ROUTES))
def test_grouped_equals_the_loop_in_bf16(route):
    """bf16 operands on both sides, padded to 64 as on cpu: each output row is the same bf16 dot products; the
    weights' gradients sum over rows in bf16 matmuls, within 1e-2 relative of the loop's."""
    g = torch.Generator().manual_seed(2)
    expert_R = ROUTES[route](g)
    x = torch.randn(len(expert_R), H, generator=g).requires_grad_()
    gate_up, down = stacks(8, seed=3)
    want = values_and_grads(looped_swiglu, x, expert_R, gate_up, down, torch.bfloat16, 64)
    got = values_and_grads(grouped_swiglu, x, expert_R, gate_up, down, torch.bfloat16, 64)
    assert got[0].dtype == torch.float32 and torch.equal(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_grouped_rows_pad_each_expert_to_the_multiple():
    expert_R = torch.tensor([2, 0, 2, 2, 0, 3])
    layout = GroupedRows.of(expert_R, 4, multiple=4)
    assert layout.offs_E.tolist() == [4, 4, 8, 12] and layout.rows == 12  # expert 1 empty: a group of no rows
    assert layout.dest_R.tolist() == [4, 0, 5, 6, 1, 8]  # in each group, rows in their order
    plain = GroupedRows.of(expert_R, 4)
    assert plain.offs_E.tolist() == [2, 2, 5, 6] and plain.dest_R.tolist() == [2, 0, 3, 4, 1, 5]


def test_an_ep_ranks_part_of_the_stack():
    """An EP shard holds experts [4, 8) of 8 as its stack [0, 4): its rows (local indices) through the grouped path
    give the whole model's outputs for them."""
    g = torch.Generator().manual_seed(4)
    gate_up, down = stacks(8, seed=5)
    global_R = torch.randint(4, 8, (90,), generator=g)
    x = torch.randn(90, H, generator=g)
    with torch.no_grad():
        whole = looped_swiglu(x, global_R, gate_up, down)
        part = grouped_swiglu(x, global_R - 4, gate_up[4:], down[4:])
    assert torch.allclose(part, whole, rtol=0, atol=1e-6)


def test_forward_rows_takes_the_grouped_path_on_cpu(monkeypatch):
    import rlhf.model.qwen3_moe as q

    calls = []
    monkeypatch.setattr(q, "grouped_swiglu", lambda *a: calls.append(a[2].dtype) or looped_swiglu(*a[:5]))
    cfg = ModelConfig(vocab_size=48, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=I)
    experts = Experts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.1)
    torch.nn.init.normal_(experts.down_proj, std=0.1)
    x, chosen = torch.randn(20, H), torch.randint(0, 8, (20,))
    experts.forward_rows(x, chosen)
    with torch.autocast("cpu", torch.bfloat16):
        experts.forward_rows(x, chosen)
    assert calls == [torch.float32, torch.bfloat16]  # under autocast, the stacks cast once, then grouped
    assert grouped_mm_supported("cpu", torch.float32) and grouped_mm_supported("cuda", torch.bfloat16)
    assert not grouped_mm_supported("cuda", torch.float32)  # torch's cuda kernel takes bf16: the loop there


def test_stacks_whose_rows_break_the_kernels_16_byte_rule_take_the_loop(monkeypatch):
    """`torch._grouped_mm` refuses strides that are not a multiple of 16 bytes (an fp32 hidden size of 6, say):
    such a model's experts take the loop, with the same outputs."""
    import rlhf.model.qwen3_moe as q

    from rlhf.model.experts import grouped_mm_fits

    odd = ModelConfig(vocab_size=48, hidden_size=6, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=5)
    experts = Experts(odd)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.3)
    torch.nn.init.normal_(experts.down_proj, std=0.3)
    assert not grouped_mm_fits(experts.gate_up_proj, experts.down_proj)
    gu, d = stacks(8)
    assert grouped_mm_fits(gu, d) and not grouped_mm_fits(gu.detach()[:, :, 1:], d)
    x, chosen = torch.randn(12, 6), torch.randint(0, 4, (12,))
    with pytest.raises(RuntimeError, match="16 bytes"):
        grouped_swiglu(x, chosen, experts.gate_up_proj, experts.down_proj)
    monkeypatch.setattr(q, "grouped_swiglu", lambda *a: pytest.fail("the grouped path for a misfit stack"))
    with torch.no_grad():
        assert torch.equal(experts.forward_rows(x, chosen),
                           looped_swiglu(x, chosen, experts.gate_up_proj, experts.down_proj))


def test_no_rows_still_reach_the_weights_and_the_input():
    """A rank that received no rows returns zeros tied to its input and weights, so its backward joins the
    all-to-all that brought the rows."""
    cfg = ModelConfig(vocab_size=48, hidden_size=H, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=I)
    experts = Experts(cfg)
    x = torch.zeros(0, H, requires_grad=True)
    y = experts.forward_rows(x, torch.zeros(0, dtype=torch.long))
    y.sum().backward()
    assert y.shape == (0, H) and x.grad is not None and experts.gate_up_proj.grad is not None


def test_replayed_routes_give_the_loops_logprobs_and_gradients(monkeypatch):
    """A whole model with routes forced (routing replay): the grouped experts' logprobs and every gradient equal
    the loop's within fp32 rounding."""
    import rlhf.model.qwen3_moe as q

    cfg = ModelConfig(vocab_size=48, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=I, rope_theta=10000.0)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed=6, std=0.1)
    ids = torch.randint(3, 48, (3, 11), generator=torch.Generator().manual_seed(7))
    forced = torch.randint(0, 8, (3, 11, 2, 2), generator=torch.Generator().manual_seed(8))
    forced[..., 1] = (forced[..., 0] + 1) % 8  # two distinct experts per token

    def run():
        model.zero_grad()
        lp, _ = model.lm_head(model.hidden_states(ids, routing=Routing(forced_BTLk=forced))[:, :-1], ids[:, 1:])
        lp.sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    lp_grouped, g_grouped = run()
    monkeypatch.setattr(q, "grouped_mm_supported", lambda *a: False)
    lp_loop, g_loop = run()
    assert torch.allclose(lp_grouped, lp_loop, rtol=0, atol=1e-6)
    assert g_grouped.keys() == g_loop.keys()
    for n in g_loop:
        assert torch.allclose(g_grouped[n], g_loop[n], rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_gradient_goes_into_the_parameters_buffer_bit_for_bit(dtype):
    """On cpu `grouped_swiglu(..., params=...)` (what `Experts.forward_rows` calls there) makes each expert's weight
    gradient by itself and adds it into the fp32 parameter's gradient buffer in place, skipping experts without
    rows: the same bits as torch's grouped backward added into the buffer (fp32 and bf16 operands), the buffer
    the same tensor, the casts without autograd."""
    g = torch.Generator().manual_seed(9)
    expert_R = ROUTES["uneven"](g)  # experts 2, 3, 5, 6, 7 empty
    x = torch.randn(len(expert_R), H, generator=g)
    gate_up, down = stacks(8, seed=10)
    w = torch.linspace(-1, 1, len(expert_R) * H).view(len(expert_R), H)
    multiple = 64 if dtype is torch.bfloat16 else 1

    casts = [p.detach().to(dtype).requires_grad_() for p in (gate_up, down)]  # torch's backward, into the casts
    (grouped_swiglu(x, expert_R, *casts, multiple).float() * w).sum().backward()
    want = [p.grad.float() for p in casts]

    buffers = [torch.full_like(p, 0.5) for p in (gate_up, down)]  # a buffer from earlier micro-batches
    for p, b in zip((gate_up, down), buffers):
        p.grad = b
    with torch.no_grad():
        plain = [p.to(dtype) for p in (gate_up, down)]  # in fp32 the parameters themselves, as forward_rows has it
    y = grouped_swiglu(x, expert_R, *plain, multiple, params=(gate_up, down))
    (y.float() * w).sum().backward()
    for p, b, ref in zip((gate_up, down), buffers, want):
        assert p.grad is b and torch.equal(b, ref + 0.5)
        assert torch.equal(b[[2, 3, 5, 6, 7]], torch.full_like(b[[2, 3, 5, 6, 7]], 0.5))
    assert dtype is torch.float32 or all(t.grad is None and t.grad_fn is None for t in plain)

    for p in (gate_up, down):  # no buffer yet: autograd accumulates the fp32 gradient
        p.grad = None
    (grouped_swiglu(x, expert_R, *plain, multiple, params=(gate_up, down)).float() * w).sum().backward()
    assert all(torch.equal(p.grad, ref) for p, ref in zip((gate_up, down), want))


@pytest.mark.parametrize("rows", [6, 11], ids=["permutation", "padded"])
def test_rows_scattered_by_a_gather_equal_the_rows_copied_into_zeros(rows):
    from rlhf.model.experts import _scatter

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(4)).bfloat16()
    dest = torch.tensor([3, 0, 5, 1, 4, 2]) if rows == 6 else torch.tensor([7, 0, 10, 1, 4, 2])
    want = torch.zeros(rows, 5, dtype=torch.bfloat16).index_copy_(0, dest, x)
    assert torch.equal(_scatter(x, dest, rows), want)
