"""Per-token logprobs and entropies of the LM head, fused and chunked over tokens.

For a policy update only two numbers per token are needed from the [tokens, vocab] logits: the sampled
token's logprob and the distribution's entropy. Materialising the logits, their float copy, the
log-softmax, its exp and their product (five [tokens, vocab] tensors, about 0.5 GB each for 4,000 tokens
of a 32,000-token vocabulary) makes the step memory-bound. Here the logits exist one chunk of tokens
at a time, in forward and again in backward (kept from the forward up to `KEEP_LOGITS_BYTES` in the
matmuls' dtype, recomputed beyond):

    z = h W^T / temperature            lse = logsumexp(z)       p = exp(z - lse)
    logp = z[target] - lse             H = lse - sum(p z)
    dL/dz = g_logp (onehot(target) - p) - g_H p (z - lse + H)        (then / temperature)

Legend: N tokens, H hidden, V vocabulary, C tokens per chunk.
"""

from __future__ import annotations

import torch

from rlhf.model.layers import Scratch, autocast_dtype, cast_once, grad_into, transposed_once

CHUNK_TOKENS = 1024  # tokens per matmul
# an update keeps its forward's logits (in the matmuls' dtype) for the backward up to this size, instead of
# recomputing them: one [1,024, 32,000] chunk is 65 MB in bf16 (131 MB in fp32), and its matmul is a quarter of
# the head's work in the update; larger calls (longer micro-batches) recompute as before
KEEP_LOGITS_BYTES = 256 * 2**20
# tokens per elementwise pass over the vocabulary: [64, V] fp32 (8 MB at V = 32,000) stays in the last-level
# cache, where a whole chunk's [1024, V] (128 MB) goes to memory and back for each of its five passes
ROWS = 64
# logits chunks (65 MB in bf16 for [1,024, 32,000]), reused across chunks, micro-batches and steps (`Scratch`);
# `release_scratch` (the trainer's offload) hands them back
SCRATCH = Scratch()
GRAD_ROWS = 2048  # rows of the weight's gradient added into its fp32 buffer at a time (a bf16 block made fp32 in cache)


def release_scratch() -> None:
    SCRATCH.release()


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, temperature: float, chunk: int, compute: torch.dtype):
        N = hidden_NH.shape[0]
        w_VH = cast_once(weight_VH, compute)  # the matmuls' operands in `compute`; logits, softmax and sums in fp32
        w_HV = transposed_once(weight_VH, compute)  # the forward's operand, contiguous where cast once per step
        logp_N = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
        ent_N, lse_N = torch.empty_like(logp_N), torch.empty_like(logp_N)
        keep = any(ctx.needs_input_grad[:2]) and N * w_VH.shape[0] * w_VH.element_size() <= KEEP_LOGITS_BYTES
        ctx.logits = [] if keep else None
        for a in range(0, N, chunk):
            h_CH = hidden_NH[a:a + chunk].to(compute)
            zc_CV = torch.mm(h_CH, w_HV, out=SCRATCH.take((h_CH.shape[0], w_HV.shape[1]), compute, h_CH.device))
            if keep:  # the backward's dL/dz overwrites them in place: the same values it would recompute
                ctx.logits.append(zc_CV)
            for r in range(0, zc_CV.shape[0], ROWS):
                i, z_RV = a + r, zc_CV[r:r + ROWS].float()
                if temperature != 1.0:
                    z_RV = z_RV / temperature
                lse_R = torch.logsumexp(z_RV, dim=-1)
                n = lse_R.shape[0]
                lse_N[i:i + n] = lse_R
                logp_N[i:i + n] = z_RV.gather(1, targets_N[i:i + n, None]).squeeze(1) - lse_R
                ent_N[i:i + n] = lse_R - torch.exp(z_RV - lse_R[:, None]).mul_(z_RV).sum(-1)
            if not keep:
                SCRATCH.give(zc_CV)
        ctx.save_for_backward(hidden_NH, w_VH, targets_N, ent_N, lse_N)
        ctx.param = weight_VH if weight_VH.is_leaf else None  # (a gathered ZeRO-3 weight is not a leaf)
        ctx.weight_dtype = weight_VH.dtype
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        hidden_NH, w_VH, targets_N, ent_N, lse_N = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden_NH) if ctx.needs_input_grad[0] else None
        # the weight's gradient: added into its fp32 gradient buffer in place where there is one (`grad_into`),
        # else summed over the chunks in fp32 and returned
        into = grad_into(ctx.param) if ctx.needs_input_grad[1] else None
        ctx.param = None
        grad_w = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) \
            if ctx.needs_input_grad[1] and into is None else None
        g_logp_N = torch.zeros_like(ent_N) if g_logp_N is None else g_logp_N.float()
        kept, ctx.logits = ctx.logits, None  # a second backward (retain_graph) recomputes them
        for j, a in enumerate(range(0, hidden_NH.shape[0], chunk)):
            h_CH = hidden_NH[a:a + chunk].to(w_VH.dtype)
            if kept is not None:  # the forward's logits; each row block is overwritten by its dL/dz
                zc_CV, kept[j] = kept[j], None
            else:  # recomputed logits, the same values
                zc_CV = torch.mm(h_CH, w_VH.T, out=SCRATCH.take((h_CH.shape[0], w_VH.shape[0]), w_VH.dtype,
                                                                 h_CH.device))
            for r in range(0, zc_CV.shape[0], ROWS):
                i, rows = a + r, slice(r, r + ROWS)
                # log p = z - lse (the forward's lse: no second logsumexp); a view of zc_CV when it is fp32
                logp_RV = zc_CV[rows].float()
                if T != 1.0:
                    logp_RV /= T
                n = logp_RV.shape[0]
                logp_RV -= lse_N[i:i + n, None]
                p_RV = torch.exp(logp_RV)
                g_lp = g_logp_N[i:i + n, None]
                # dL/dz = g_logp (onehot - p) - g_H p (log p + H); without an entropy gradient only the first term
                if g_ent_N is None:
                    dz_RV = p_RV.mul_(-g_lp)
                else:
                    g_h = g_ent_N[i:i + n, None].float()
                    dz_RV = logp_RV.add_(ent_N[i:i + n, None]).mul_(g_h).add_(g_lp).mul_(p_RV).neg_()
                dz_RV.scatter_add_(1, targets_N[i:i + n, None], g_lp)
                if T != 1.0:
                    dz_RV /= T
                zc_CV[rows] = dz_RV
            if grad_h is not None:
                grad_h[a:a + chunk] = zc_CV @ w_VH
            if into is not None or grad_w is not None:  # (a bf16 [V, H] product is under glibc's mmap threshold)
                _add_rows(into if into is not None else grad_w, zc_CV.T @ h_CH)
            SCRATCH.give(zc_CV)
        return grad_h, None if grad_w is None else grad_w.to(ctx.weight_dtype), None, None, None, None


def _add_rows(into: torch.Tensor, g: torch.Tensor) -> None:
    """into += g, a block of rows at a time where g is narrower than into (bf16 into fp32: a mixed-dtype add_ runs
    at a third of a cast block by block plus an fp32 add)."""
    if g.dtype == into.dtype:
        into.add_(g)
        return
    for r in range(0, g.shape[0], GRAD_ROWS):
        into[r:r + GRAD_ROWS].add_(g[r:r + GRAD_ROWS].to(into.dtype))


def head_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, targets_BT: torch.Tensor,
                  temperature: float = 1.0, chunk: int = CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp, entropy) [B, T] in fp32: log softmax(h W^T / temperature)[target] and the entropy of that
    distribution, for every position of `hidden_BTH` (with `targets_BT` its next tokens). Under autocast
    (`trainer.compute_dtype`) the two matmuls of forward and backward take its dtype, the weight cast once
    per call (per step inside `casts_kept`); the rest, and the weight's gradient summed over the chunks, stays in fp32."""
    B, T, H = hidden_BTH.shape
    device_type = hidden_BTH.device.type
    compute = autocast_dtype(device_type) or weight_VH.dtype
    with torch.autocast(device_type, enabled=False):
        logp_N, ent_N = _HeadLogprobs.apply(hidden_BTH.reshape(B * T, H), weight_VH, targets_BT.reshape(-1),
                                            float(temperature), int(chunk), compute)
    return logp_N.view(B, T), ent_N.view(B, T)
