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

from rlhf.model.layers import (ADD_SCRATCH, CompiledKernels, EagerKernels, Scratch, add_into, autocast_dtype, cast_once,
                               grad_into, transposed_once)

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


def release_scratch() -> None:
    SCRATCH.release()
    ADD_SCRATCH.release()


def rows_forward(z_RV: torch.Tensor, targets_R: torch.Tensor, temperature: torch.Tensor | None):
    """(lse, logp of the target, entropy) in fp32 of rows of logits (in the matmuls' dtype), divided by
    `temperature` (None: 1)."""
    z = z_RV.float()
    if temperature is not None:
        z = z / temperature
    if torch.compiler.is_compiling():  # one exp pass for both sums
        m = z.amax(-1, keepdim=True)
        e = torch.exp(z - m)
        s = e.sum(-1)
        lse = m.squeeze(1) + torch.log(s)
        ent = lse - (e * z).sum(-1) / s
    else:  # the eager head's arithmetic as it was before it was compiled: the same values, bit for bit
        lse = torch.logsumexp(z, dim=-1)
        ent = lse - torch.exp(z - lse[:, None]).mul_(z).sum(-1)
    return lse, z.gather(1, targets_R[:, None]).squeeze(1) - lse, ent


def rows_backward(z_RV: torch.Tensor, targets_R: torch.Tensor, lse_R: torch.Tensor, ent_R: torch.Tensor,
                  g_logp_R: torch.Tensor, g_ent_R: torch.Tensor | None, temperature: torch.Tensor | None) -> None:
    """dL/dz over rows of logits, written over them in place: g_logp (onehot(target) - p) - g_H p (log p + H),
    divided by `temperature`."""
    logp = z_RV.float()  # (in place from here: fresh [64, V] fp32 temporaries cost more than the arithmetic
    if temperature is not None:  # in eager torch; z_RV itself when it is fp32, overwritten at the end anyway)
        logp /= temperature
    logp -= lse_R[:, None]
    p = torch.exp(logp)
    g_lp = g_logp_R[:, None]
    if g_ent_R is None:
        dz = p.mul_(-g_lp)
    else:
        dz = logp.add_(ent_R[:, None]).mul_(g_ent_R[:, None]).add_(g_lp).mul_(p).neg_()
    if torch.compiler.is_compiling():  # fused: the target's column picked in the same pass
        hit = torch.arange(z_RV.shape[1], device=z_RV.device)[None, :] == targets_R[:, None]
        dz = torch.where(hit, dz + g_lp, dz)
    else:
        dz.scatter_add_(1, targets_R[:, None], g_lp)
    if temperature is not None:
        dz /= temperature
    z_RV.copy_(dz)


class RowKernels(CompiledKernels):
    """`rows_forward` and `rows_backward`, compiled by torch.compile (inductor's C++ on cpu) where that pays: in
    eager torch each is about ten passes over a [64, V] block (a copy to fp32, max, subtract, exp, sums, products),
    compiled a few fused loops per row: forward 8.5-10.6 -> 2.1-2.2 ms, backward 6.1-6.5 -> 3.3-3.4 ms a
    [64, 32,000] block on one thread (`python -m benchmarks.cpu_kernels --only head_rows`). The first call in a
    process compiles (8-11 s, inductor's cache on disk or not); a compile that fails (no C++ compiler) is logged
    once and the eager functions serve from then on."""

    def __init__(self):
        super().__init__("the LM head's row kernels", rows_forward, rows_backward)


EagerRowKernels = EagerKernels(rows_forward, rows_backward)
COMPILE_MIN_VOCAB = 4096  # below it the blocks are small and the first call's compile would cost more than it saves
COMPILED = RowKernels()


def row_kernels(device: torch.device, vocab: int):
    """The compiled row kernels on cpu for a vocabulary of COMPILE_MIN_VOCAB or more, else the eager ones (other
    devices: eager until measured there)."""
    return COMPILED if device.type == "cpu" and vocab >= COMPILE_MIN_VOCAB else EagerRowKernels


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
        kernels = row_kernels(hidden_NH.device, w_VH.shape[0])
        temp = None if temperature == 1.0 else torch.tensor(temperature, dtype=torch.float32)
        for a in range(0, N, chunk):
            h_CH = hidden_NH[a:a + chunk].to(compute)
            zc_CV = torch.mm(h_CH, w_HV, out=SCRATCH.take((h_CH.shape[0], w_HV.shape[1]), compute, h_CH.device))
            if keep:  # the backward's dL/dz overwrites them in place: the same values it would recompute
                ctx.logits.append(zc_CV)
            for r in range(0, zc_CV.shape[0], ROWS):
                i, n = a + r, min(ROWS, zc_CV.shape[0] - r)
                lse_N[i:i + n], logp_N[i:i + n], ent_N[i:i + n] = kernels.forward(
                    zc_CV[r:r + n], targets_N[i:i + n], temp)
            if not keep:
                SCRATCH.give(zc_CV)
        ctx.save_for_backward(hidden_NH, w_VH, targets_N, ent_N, lse_N)
        ctx.param = weight_VH if weight_VH.is_leaf else None  # (a gathered ZeRO-3 weight is not a leaf)
        ctx.weight_dtype = weight_VH.dtype
        ctx.chunk, ctx.kernels, ctx.temp = chunk, kernels, temp
        return logp_N, ent_N

    @staticmethod
    def backward(ctx, g_logp_N, g_ent_N):
        hidden_NH, w_VH, targets_N, ent_N, lse_N = ctx.saved_tensors
        chunk = ctx.chunk
        grad_h = torch.empty_like(hidden_NH) if ctx.needs_input_grad[0] else None
        # the weight's gradient: added into its fp32 gradient buffer in place where there is one (`grad_into`),
        # else summed over the chunks in fp32 and returned
        into = grad_into(ctx.param) if ctx.needs_input_grad[1] else None
        ctx.param = None
        grad_w = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) \
            if ctx.needs_input_grad[1] and into is None else None
        g_logp_N = torch.zeros_like(ent_N) if g_logp_N is None else g_logp_N.float()
        kept, ctx.logits = ctx.logits, None  # a second backward (retain_graph) recomputes them
        kernels, temp = ctx.kernels, ctx.temp
        for j, a in enumerate(range(0, hidden_NH.shape[0], chunk)):
            h_CH = hidden_NH[a:a + chunk].to(w_VH.dtype)
            if kept is not None:  # the forward's logits; each row block is overwritten by its dL/dz
                zc_CV, kept[j] = kept[j], None
            else:  # recomputed logits, the same values
                zc_CV = torch.mm(h_CH, w_VH.T, out=SCRATCH.take((h_CH.shape[0], w_VH.shape[0]), w_VH.dtype,
                                                                 h_CH.device))
            for r in range(0, zc_CV.shape[0], ROWS):
                i, n = a + r, min(ROWS, zc_CV.shape[0] - r)
                kernels.backward(zc_CV[r:r + n], targets_N[i:i + n], lse_N[i:i + n], ent_N[i:i + n],
                                 g_logp_N[i:i + n], None if g_ent_N is None else g_ent_N[i:i + n].float(), temp)
            if grad_h is not None:
                grad_h[a:a + chunk] = zc_CV @ w_VH
            if into is not None or grad_w is not None:  # the [V, H] product into a reused buffer too: fresh,
                # it took 1.5-1.9x as long (update_profile --ranks 1 --by-shape, the [32000, 945] row)
                wg_VH = torch.mm(zc_CV.T, h_CH, out=SCRATCH.take(tuple(w_VH.shape), w_VH.dtype, h_CH.device))
                add_into(into if into is not None else grad_w, wg_VH)
                SCRATCH.give(wg_VH)
            SCRATCH.give(zc_CV)
        return grad_h, None if grad_w is None else grad_w.to(ctx.weight_dtype), None, None, None, None


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
