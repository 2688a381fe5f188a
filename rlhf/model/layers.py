"""Building blocks both decoder families share."""

from __future__ import annotations

import logging
import math
import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class CompiledKernels:
    """A forward and a backward function compiled by torch.compile (inductor's C++ on cpu) at their first call, for
    elementwise passes that eager torch runs as many: each op a pass over memory and a fresh temporary. A compile
    that fails (no C++ compiler) is logged once and the eager functions serve from then on: the same maths."""

    def __init__(self, what: str, forward, backward):
        self.what, self.functions = what, (forward, backward)
        self.lock, self.compiled = threading.Lock(), None

    def _compiled(self):
        if self.compiled is None:  # (the lock only until they exist: this runs for every call)
            with self.lock:
                if self.compiled is None:
                    self.compiled = tuple(torch.compile(f, dynamic=True) for f in self.functions)
        return self.compiled

    def _call(self, i: int, *args):
        compiled = self._compiled()
        if compiled:
            try:
                return compiled[i](*args)
            except Exception as e:  # noqa: BLE001 (inductor raises its own kinds; eager computes the same)
                log.warning("%s could not be compiled (%s: %s); running them in eager torch", self.what,
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                self.compiled = False
        return self.functions[i](*args)

    def forward(self, *args):
        return self._call(0, *args)

    def backward(self, *args):
        return self._call(1, *args)


class EagerKernels:
    """`CompiledKernels`' interface over the functions themselves."""

    def __init__(self, forward, backward):
        self.forward, self.backward = forward, backward


def norm_forward(x_NH: torch.Tensor, w_H: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): y = w * (x r) in x's dtype, r = 1 / rms(x) per row in fp32, the normalising in fp32."""
    x32 = x_NH.float()
    r_N1 = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return w_H * (x32 * r_N1).to(x_NH.dtype), r_N1


def norm_backward(g_NH: torch.Tensor, x_NH: torch.Tensor, r_N1: torch.Tensor, w_H: torch.Tensor):
    """(dL/dx in x's dtype, dL/dw in fp32) of `norm_forward`: with n = x r, dL/dn = g w (in x's dtype, as autograd
    of the eager norm rounds it), dL/dx = r dL/dn - x r^3 mean(dL/dn x); dL/dw = sum over rows of g n."""
    x32 = x_NH.float()
    n = (x32 * r_N1).to(x_NH.dtype)
    g_w = (g_NH.float() * n.float()).sum(0)
    g_n = (g_NH * w_H).float()
    dot_N1 = (g_n * x32).mean(-1, keepdim=True)
    return (g_n * r_N1 - x32 * (r_N1 * r_N1 * r_N1 * dot_N1)).to(x_NH.dtype), g_w


NORM_KERNELS = CompiledKernels("the RMSNorm kernels", norm_forward, norm_backward)
EAGER_NORM_KERNELS = EagerKernels(norm_forward, norm_backward)
# a norm over fewer elements than this runs the eager kernels: the compile (2-5 s) would cost more than it saves
NORM_COMPILE_MIN_ELEMENTS = 1 << 16


class _LowPrecisionNorm(torch.autograd.Function):
    """RMSNorm of a bf16 (fp16) activation in two passes forward and two backward (`norm_forward`,
    `norm_backward`), compiled on cpu for large inputs, where autograd of the eager ops makes about twenty, several
    over broadcast operands: 0.19 against 1.8 ms forward and backward of a [675, 512] bf16 input on one thread."""

    @staticmethod
    def forward(ctx, x_NH, weight_H, w_H, eps: float):
        kernels = NORM_KERNELS if x_NH.device.type == "cpu" and x_NH.numel() >= NORM_COMPILE_MIN_ELEMENTS \
            else EAGER_NORM_KERNELS
        with torch.autocast(x_NH.device.type, enabled=False):  # (its dtypes are explicit)
            y_NH, r_N1 = kernels.forward(x_NH, w_H, eps)
        ctx.save_for_backward(x_NH, r_N1, w_H)
        ctx.kernels, ctx.weight_dtype = kernels, weight_H.dtype
        return y_NH

    @staticmethod
    def backward(ctx, g_NH):
        x_NH, r_N1, w_H = ctx.saved_tensors
        g_x, g_w = ctx.kernels.backward(g_NH.contiguous(), x_NH, r_N1, w_H)
        return g_x, g_w.to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None, None, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised in fp32, scaled in `x`'s dtype: a bf16 residual stream stays bf16 (the weight cast once per
        step, `cast_once`), as HF's norm of a bf16 model computes. A bf16 or fp16 `x` takes `_LowPrecisionNorm`
        (the same forward values; its backward sums the weight's gradient in fp32, where autograd rounds it to x's
        dtype first); fp32 the eager ops, as before."""
        if x.dtype in (torch.bfloat16, torch.float16):
            shape = x.shape
            with torch.no_grad():  # the gradient reaches the parameter from `_LowPrecisionNorm`'s backward
                w = cast_once(self.weight, x.dtype)
            return _LowPrecisionNorm.apply(x.reshape(-1, shape[-1]), self.weight, w, self.eps).view(shape)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return cast_once(self.weight, x.dtype) * x32.to(x.dtype)


def residual(x: torch.Tensor) -> torch.Tensor:
    """The residual stream in the compute dtype under autocast (`trainer.compute_dtype`: bf16 activations over
    fp32 parameters, as Megatron's bf16 training keeps them), as it is otherwise."""
    dtype = autocast_dtype(x.device.type)
    return x if dtype is None or x.dtype == dtype else x.to(dtype)


def grad_into(p: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient a backward may add `p`'s gradient into in place, skipping the full-size gradient autograd would
    otherwise make, zero and add (Megatron's gradient-accumulation fusion): a leaf parameter's fp32 `.grad` that is
    already there (the trainer zeroes its gradient buffers before a step), outside a double backward. None: the
    backward returns the gradient and autograd accumulates it. The sum is the same but for the order of additions
    (bit for bit at the first micro-batch, into zeros)."""
    g = p.grad if p is not None and p.is_leaf and p.requires_grad else None
    if g is None or g.dtype != torch.float32 or g.shape != p.shape or g.layout != torch.strided \
            or not g.is_contiguous() or torch.is_grad_enabled():
        return None
    return g


ADD_BLOCK = 1 << 20  # elements of a low-precision gradient made fp32 and added at a time (4 MB: in cache)


def add_into(into: torch.Tensor, g: torch.Tensor) -> None:
    """into += g. A g of another dtype (a bf16 gradient into an fp32 buffer) is cast and added a block of rows at a
    time, in cache: a mixed-dtype `add_` runs at a third of that, and casting it whole first makes a full-size fp32
    copy (the small model's head gradient: 43-46 ms against 17 ms, `python -m benchmarks.cpu_kernels --only head`)."""
    if g.dtype == into.dtype:
        into.add_(g)
        return
    width = into.shape[-1] if into.dim() else 1
    into2, g2 = into.view(-1, width), g.reshape(-1, width)
    step = max(1, ADD_BLOCK // width)
    # one block buffer for the whole call, kept between calls (`ADD_SCRATCH`): a fresh 4 MB cast per block is
    # faulted in anew in a training step's churned heap (0.8 ms a [2,048, 512] block in `update_profile --by-shape`)
    block = ADD_SCRATCH.take((min(step, into2.shape[0]), width), into.dtype, into.device)
    for r in range(0, into2.shape[0], step):
        part = block[:min(step, into2.shape[0] - r)]
        part.copy_(g2[r:r + step])
        into2[r:r + step].add_(part)
    ADD_SCRATCH.give(block)


class _CastInto(torch.autograd.Function):
    """`p.to(dtype)` for a parameter cast once per step (`cast_once`), whose backward adds each micro-batch's
    gradient into p's fp32 gradient buffer in place (`grad_into`, `add_into`) instead of autograd's fresh fp32
    copy of it that AccumulateGrad then adds: the experts' [16, 512, 512] and [16, 512, 256] bf16 gradients per
    layer and micro-batch on the small model's EP rank. Nothing is saved for the backward, so the one cast serves
    every micro-batch's backward."""

    @staticmethod
    def forward(ctx, p, dtype):
        ctx.param = p
        return p.detach().to(dtype)

    @staticmethod
    def backward(ctx, g):
        into = grad_into(ctx.param)
        if into is None:
            return g.to(ctx.param.dtype), None
        add_into(into, g)
        return None, None


class _EmbeddingInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.param = weight if weight.is_leaf else None  # a gathered (ZeRO-3) weight is not kept alive for this
        ctx.rows = weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        into = grad_into(ctx.param)
        if into is None:
            return None, torch.ops.aten.embedding_dense_backward(grad, ids, ctx.rows, -1, False)
        into.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(into.dtype))
        return None, None


class Embedding(nn.Embedding):
    """nn.Embedding (same parameters and state) whose backward adds each token's row into the weight's gradient
    buffer in place (`grad_into`) instead of a zero-filled [vocab, hidden] gradient per micro-batch added to it
    afterwards: two passes over 65 MB per micro-batch for the small model's fp32 embedding."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if (self.padding_idx is not None or self.max_norm is not None or self.sparse or self.scale_grad_by_freq
                or not (torch.is_grad_enabled() and self.weight.requires_grad)):
            return super().forward(ids)
        return _EmbeddingInto.apply(ids, self.weight)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype matmuls compute in under an enabled `torch.autocast` for this device type, or None (the
    trainer's `trainer.compute_dtype`: fp32 parameters, bf16 matmuls)."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


_kept = threading.local()  # .casts: {(id, dtype): (parameter, its version, the cast)} while `casts_kept` is open


@contextmanager
def casts_kept(device_type: str, dtype: torch.dtype | None):
    """One optimizer step's (or one logprob pass's) mixed precision: autocast to `dtype` entered once around all
    its micro-batches, so that each parameter is cast to the compute dtype once, at its first use, and that copy
    serves every micro-batch (autocast's own cache for the ops it casts, `cast_once` for the casts the model makes
    itself), instead of every weight cast again in every micro-batch's forward. Backward passes inside go under
    `autocast_off`. The copies are dropped when the scope closes, before the optimizer changes the parameters.
    `dtype` None: no autocast, nothing kept."""
    if dtype is None:
        yield
        return
    outer = getattr(_kept, "casts", None) is None
    if outer:
        _kept.casts = {}
    try:
        with torch.autocast(device_type, dtype):
            yield
    finally:
        if outer:
            _kept.casts = None


def autocast_off(device_type: str):
    """A backward inside `casts_kept`: its ops in the dtypes the forward chose, as outside autocast (autocast's
    cache lives on while a nested context has it off)."""
    return torch.autocast(device_type, enabled=False)


def cast_once(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype)`; inside `casts_kept`, a parameter (a leaf) is cast once and the same copy (with its autograd
    node: gradients reach the parameter through it from every micro-batch) handed out again until the scope
    closes or the parameter changes."""
    casts = getattr(_kept, "casts", None)
    if t.dtype == dtype or casts is None or not t.is_leaf:
        return t.to(dtype)
    key = (id(t), dtype, torch.is_grad_enabled())  # a copy made without autograd serves no backward
    hit = casts.get(key)
    if hit is None or hit[0] is not t or hit[1] != t._version:
        grad = key[2] and t.requires_grad
        hit = casts[key] = (t, t._version, _CastInto.apply(t, dtype) if grad else t.to(dtype))
    return hit[2]


def transposed_once(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t.to(dtype).T` laid out contiguously, made once per `casts_kept` scope (no autograd: for a custom backward's
    own use); outside one, the transposed view of the cast, no copy. oneDNN multiplies by a contiguous [in, out]
    operand faster than by the transposed view of an [out, in] one (the small model's head: 39-40 against 50-55 ms
    a 1,024-token chunk in bf16 on one thread, `python -m benchmarks.cpu_kernels --only head --repeats 40`)."""
    casts = getattr(_kept, "casts", None)
    if casts is None or not t.is_leaf:
        return t.to(dtype).T
    key = (id(t), dtype, "T")
    hit = casts.get(key)
    if hit is None or hit[0] is not t or hit[1] != t._version:
        with torch.no_grad():  # (from the step's cast where there is one: one conversion of the weight, not two)
            hit = casts[key] = (t, t._version, cast_once(t, dtype).T.contiguous())
    return hit[2]


class Scratch:
    """Large buffers reused instead of allocated afresh (cpu only): glibc hands every allocation over 32 MiB back
    to the kernel at its free, and the kernel zeroes each page of the next one at first touch, which costs more
    than the arithmetic that fills it (a [1,024, 32,000] bf16 logits chunk: 90-168 ms into a fresh tensor, 50-55 ms
    into a reused one: `python -m benchmarks.cpu_kernels --only head`). `take` returns a contiguous tensor of the
    shape in a kept buffer large enough, or a new one; `give` hands it back once nothing reads it. At most `keep`
    buffers are held; `release` drops them all."""

    def __init__(self, keep: int = 4):
        self.keep, self.free, self.lock = keep, [], threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        if device.type == "cpu":
            with self.lock:
                fits = [i for i, b in enumerate(self.free) if b.dtype == dtype and b.numel() >= n]
                if fits:
                    base = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
                    return base[:n].view(shape)
        return torch.empty(n, dtype=dtype, device=device).view(shape)

    def give(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        if base.device.type != "cpu" or base.dim() != 1:
            return
        with self.lock:
            if any(b is base for b in self.free):
                return
            self.free.append(base)
            if len(self.free) > self.keep:
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))

    def release(self) -> None:
        with self.lock:
            self.free.clear()


ADD_SCRATCH = Scratch(keep=1)  # `add_into`'s block buffer (4 MB); released with the head's at the trainer's offload


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """`inv` with inv[order[i]] = i (argsort of a permutation, without the sort)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute_rows(x: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """`x[order]` for a permutation `order` of x's rows (`inverse` its inverse, if at hand). The same values and
    gradients as indexing, whose backward zero-fills a gradient of x's size and adds into it with an
    index_put; a permutation's gradient is a gather by the inverse (index_put, fill and index held up to 0.7 s of
    an 8.8 s bf16 update step's profile, `python -m benchmarks.update_profile --ranks 2 --compute-dtype bfloat16`)."""
    return _PermuteRows.apply(x, order, inverse_permutation(order) if inverse is None else inverse)


SHORT_SEQUENCE = 256  # tokens: up to here a bf16 training forward on cpu takes `_ShortAttention`


class _ShortAttention(torch.autograd.Function):
    """Attention with FlashAttention-2's numerics on cpu, for short bf16 sequences: the scores QK^T and the
    probabilities' gradient dO V^T in fp32 from the bf16 operands, softmax and its backward in fp32, the
    probabilities and the scores' gradient rounded to bf16 for the products with V, dO, K and Q (bf16 multiplies,
    fp32 sums). Query heads grouped by their KV head (SDPA's `enable_gqa` order), so K and V are never repeated.
    SDPA's math path computes all of it in fp32, about twice the time, and its flash kernel's backward is slower
    still on short sequences (`python -m benchmarks.cpu_kernels --only attention`; its `scores_bmm_*` fields: bf16
    products 4x as fast as fp32's here). Inputs [B, N, T, D], [B, K, T, D], [B, K, T, Dv]; `mask` bool,
    broadcastable to [B, 1, T, T] (True: attend), with every query row attending somewhere."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        B, N, T, D = q.shape
        K, Dv = k.shape[1], v.shape[-1]
        G = N // K
        with torch.autocast("cpu", enabled=False):
            q3, k3 = q.contiguous().view(B * K, G * T, D), k.contiguous().view(B * K, T, D)
            v3 = v.contiguous().view(B * K, T, Dv)
            s = torch.bmm(q3.float(), k3.float().transpose(1, 2)).mul_(scale).view(B, K, G, T, T)
            s.masked_fill_(~mask[:, :, None], float("-inf"))
            p = torch.softmax(s, -1).view(B * K, G * T, T)
            out = torch.bmm(p.to(q.dtype), v3)
        ctx.save_for_backward(q3, k3, v3, p)
        ctx.scale, ctx.shape = scale, (B, N, K, T, D, Dv)
        return out.view(B, N, T, Dv)

    @staticmethod
    def backward(ctx, grad):
        q3, k3, v3, p = ctx.saved_tensors
        B, N, K, T, D, Dv = ctx.shape
        with torch.autocast("cpu", enabled=False):
            g3 = grad.to(q3.dtype).contiguous().view(B * K, -1, Dv)
            dv = torch.bmm(p.to(q3.dtype).transpose(1, 2), g3)
            dp = torch.bmm(g3.float(), v3.float().transpose(1, 2))
            ds = torch._softmax_backward_data(dp, p, -1, torch.float32).mul_(ctx.scale).to(q3.dtype)
            dq, dk = torch.bmm(ds, k3), torch.bmm(ds.transpose(1, 2), q3)
        return dq.view(B, N, T, D), dk.view(B, K, T, D), dv.view(B, K, T, Dv), None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` (bool `mask`: True attends). A bf16 forward on cpu that records for a
    backward over sequences up to SHORT_SEQUENCE tokens takes `_ShortAttention` (FlashAttention-2's numerics,
    about 2x SDPA's math path and 3x its flash kernel there, forward and backward); elsewhere SDPA's default,
    which also refuses heads that do not group (`enable_gqa` off with fewer KV heads, or heads not a multiple)."""
    dtype = autocast_dtype(q.device.type) or q.dtype  # SDPA computes in autocast's dtype
    if (q.device.type == "cpu" and dtype is torch.bfloat16 and q.shape[-2] <= SHORT_SEQUENCE
            and torch.is_grad_enabled() and q.requires_grad
            and mask.dtype is torch.bool and mask.dim() == 4 and mask.shape[1] == 1
            and (q.shape[1] == k.shape[1] or enable_gqa and q.shape[1] % k.shape[1] == 0)):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return _ShortAttention.apply(*(x.to(dtype) for x in (q, k, v)), mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def full_precision_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in the operands' own dtype even under autocast: MoE routers choose experts in the parameters'
    precision (a bf16 router flips near-tied choices; Megatron keeps its routers in fp32 likewise)."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.nn.functional.linear(x, weight)
