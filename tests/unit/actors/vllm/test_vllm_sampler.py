"""The engines' inverse-transform sampler (actors/vllm/sampler.py): draws from softmax(logits), never a token
of probability 0 (top-k / top-p masks, block padding), the same token for the same uniform whatever the batch,
and vLLM's sampler takes it once the worker extension is loaded."""

import math

import torch

from actors.vllm.sampler import BLOCK, sample_inverse_cdf, uniforms


def test_frequencies_match_the_probabilities():
    g = torch.Generator().manual_seed(0)
    V, draws = 2 * BLOCK + 37, 200_000  # three blocks, the last one padded
    probs = torch.softmax(torch.randn(V, generator=g) * 2, -1)
    u = torch.rand(draws, dtype=torch.float64, generator=g)
    counts = torch.bincount(sample_inverse_cdf(probs.expand(draws, V), u), minlength=V).double()
    expected = probs.double() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # chi-square with V - 1 = 292 degrees of freedom: mean 292, sd 24; 400 is beyond 4 sd
    assert chi2 < 400, chi2


def test_tokens_of_probability_zero_are_never_chosen():
    V = 3 * BLOCK
    probs = torch.zeros(V)
    live = [0, BLOCK - 1, BLOCK, 2 * BLOCK + 5]  # at block edges, around empty stretches
    probs[live] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    # uniforms at the extremes (0: the draw lands on the total; just under 1: next to 0) and every boundary
    u = torch.tensor([0.0, 1 - 2 ** -53, 0.9, 0.7, 0.4, 0.6, 0.3, 0.8, 0.1], dtype=torch.float64)
    got = sample_inverse_cdf(probs.expand(len(u), V), u)
    assert set(got.tolist()) <= set(live)
    assert got[0] == live[-1] and got[1] == live[0]


def test_a_row_is_sampled_from_its_own_uniform_whatever_the_batch():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(6, 1000, generator=g), -1)
    u = torch.rand(6, dtype=torch.float64, generator=g)
    whole = sample_inverse_cdf(probs, u)
    for i in range(6):
        assert sample_inverse_cdf(probs[i:i + 1], u[i:i + 1]).item() == whole[i].item()


def test_seeded_rows_draw_from_their_own_generator():
    gens = {1: torch.Generator().manual_seed(7), 3: torch.Generator().manual_seed(8)}
    u = uniforms(4, gens)
    assert u.dtype == torch.float64 and u.shape == (4,)
    assert u[1] == torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    assert u[3] == torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    assert all(0 <= x < 1 for x in u.tolist()) and not math.isnan(float(u.sum()))
    state = torch.get_rng_state()  # every row seeded: torch's global generator is not drawn from
    uniforms(2, {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)})
    assert torch.equal(state, torch.get_rng_state())


def test_vllms_cpu_sampler_takes_it():
    import actors.vllm.worker_ext  # noqa: F401  (applies the patch, as in every vLLM worker)
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    sampler = TopKTopPSampler()
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 500, generator=g)
    logits[:, 100:] = -float("inf")  # as top-k leaves them
    gens = {i: torch.Generator().manual_seed(10 + i) for i in range(3)}
    tokens, processed = sampler(logits.clone(), gens, None, None)
    want = sample_inverse_cdf(torch.softmax(logits, -1),
                              uniforms(3, {i: torch.Generator().manual_seed(10 + i) for i in range(3)}))
    assert processed is None and torch.equal(tokens.view(-1), want) and bool((tokens < 100).all())
