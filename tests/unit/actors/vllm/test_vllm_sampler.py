"""The engines' inverse-transform sampler (actors/vllm/sampler.py): draws from softmax(logits), never a token
of probability 0 (top-k / top-p masks, block padding), the same token for the same uniform whatever the batch,
and vLLM's sampler takes it once the worker extension is loaded."""

import math

import pytest

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


def metadata(B, gens, temperature=1.0, max_num_logprobs=0, top_p=None, procs=()):
    from vllm.v1.sample.logits_processor.state import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((B,), temperature), all_greedy=False, all_random=True, top_p=top_p, top_k=None,
        generators=gens, max_num_logprobs=max_num_logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(B), presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(procs))


def seeded(B, base=20):
    return {i: torch.Generator().manual_seed(base + i) for i in range(B)}


@pytest.mark.parametrize("V", [1000, 32 * BLOCK], ids=["padded", "whole_blocks"])
def test_the_plain_mode_draws_what_vllms_path_draws_with_its_logprobs_and_ranks(V):
    """vLLM's `Sampler.forward` in the plain mode an RL rollout asks for (temperature 1, the sampled token's own
    logprob): our one-pass path against vLLM's own (its log-softmax, softmax, our inverse-transform draw, its rank)
    from the same seeds: the same tokens, logprobs within fp32 rounding, the same ranks."""
    import actors.vllm.worker_ext  # noqa: F401  (applies the patches, as in every vLLM worker)
    from vllm.v1.sample.sampler import Sampler

    B = 6
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    sampler = Sampler()
    ours = sampler(logits.clone(), metadata(B, seeded(B)))
    theirs = Sampler.forward._rlhf_original(sampler, logits.clone(), metadata(B, seeded(B)))
    assert torch.equal(ours.sampled_token_ids, theirs.sampled_token_ids)
    assert ours.sampled_token_ids.dtype == torch.int32 and ours.sampled_token_ids.shape == (B, 1)
    a, b = ours.logprobs_tensors, theirs.logprobs_tensors
    assert torch.equal(a.logprob_token_ids, b.logprob_token_ids) and a.logprob_token_ids.dtype == torch.int32
    assert a.logprobs.shape == b.logprobs.shape == (B, 1) and torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert torch.equal(a.selected_token_ranks, b.selected_token_ranks)
    none = sampler(logits.clone(), metadata(B, seeded(B), max_num_logprobs=None))  # no logprobs asked
    assert none.logprobs_tensors is None and torch.equal(none.sampled_token_ids, theirs.sampled_token_ids)


def test_anything_but_the_plain_mode_takes_vllms_path():
    import actors.vllm.worker_ext  # noqa: F401
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor
    from vllm.v1.sample.sampler import Sampler

    from actors.vllm.sampler import plain_sampling

    sampler, B = Sampler(), 2
    idle_bias = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    min_p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    min_p.min_p_count = 0
    assert plain_sampling(sampler, metadata(B, {}, procs=[idle_bias, min_p]), False, None)
    min_p.min_p_count = 1  # a request with min_p
    assert not plain_sampling(sampler, metadata(B, {}, procs=[min_p]), False, None)
    assert not plain_sampling(sampler, metadata(B, {}, temperature=0.7), False, None)
    assert not plain_sampling(sampler, metadata(B, {}, top_p=torch.full((B,), 0.9)), False, None)
    assert not plain_sampling(sampler, metadata(B, {}, max_num_logprobs=5), False, None)
    assert not plain_sampling(sampler, metadata(B, {}), True, None)  # speculative decoding's bonus token
    assert not plain_sampling(sampler, metadata(B, {}), False, "processed_logprobs")

    class Custom(LogitBiasLogitsProcessor):  # a processor we do not know: vLLM's path
        pass

    assert not plain_sampling(sampler, metadata(B, {}, procs=[Custom(None, torch.device("cpu"), False)]), False, None)


def test_the_compiled_plain_kernels_draw_and_score_as_the_eager_ones(monkeypatch):
    """The run's shape (64 x 32,000 logits) takes the compiled kernels: the same tokens from the same seeds as the
    eager functions, logprobs within fp32 rounding, the same ranks."""
    import actors.vllm.sampler as sampler_mod
    from actors.vllm.sampler import sample_plain

    B, V = 64, 32_000
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    monkeypatch.setattr(sampler_mod, "SAMPLE_COMPILE_MIN_ELEMENTS", 10 ** 12)
    eager = sample_plain(logits, seeded(B), True)
    monkeypatch.setattr(sampler_mod, "SAMPLE_COMPILE_MIN_ELEMENTS", 0)
    compiled = sample_plain(logits, seeded(B), True)
    assert sampler_mod.SAMPLE_KERNELS.compiled, "torch.compile failed"
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[2], compiled[2])
    assert torch.allclose(eager[1], compiled[1], atol=1e-5)
    want = logits.float().log_softmax(-1).gather(1, eager[0][:, None]).squeeze(1)
    assert torch.allclose(compiled[1], want, atol=1e-5)
