"""Low-precision formats of rollout weights, and the reference quantizer every copy of them is checked against.

`fp8_block` (`rollout.quantization`, docs/quantized_rollout.md): the layout of DeepSeek-V3's own checkpoints and
of vLLM's block-FP8 kernels. A weight `[..., N, K]` is cut into 128 x 128 blocks of its last two dims (the
blocks at the far edges may be partial); each block keeps one fp32 scale, `weight_scale_inv[..., N/128, K/128]`
(rounded up), the block's largest magnitude over 448 (float8_e4m3fn's largest finite value), and its values
`float8_e4m3fn(w / scale)`. Dequantized, `w ~ q * scale`. An all-zero block gets the scale of a block whose
largest magnitude is `TINY` (its values stay 0, so nothing divides by zero).

`int8_channel`: a weight `[..., N, K]` keeps one fp32 scale a row, `weight_scale[..., N, 1]`, the row's largest
magnitude over 127, and its values `int8(round(w / scale))` (round half to even, in [-127, 127]). An all-zero row
is scaled as one whose largest magnitude is `TINY`. The engines quantize activations per token themselves (W8A8).

The maths is per block (per row) and per element: quantizing a block-aligned region (whole rows) of a tensor gives
exactly the values and scales that quantizing the whole tensor gives there (the tests hold the quantizer to that,
and the owners of a tensor's regions rely on it: each quantizes the blocks it holds).

The tensors' side of a quantized sync: an owner's buffers in wire form (`OwnerWire`), a receiver's bytes seen as
the engine's tensors (`typed_views`) and checked (`nonfinite`). Which tensors are quantized and the wire's spec
are `weight_sync.wire` (pure; its names are importable from here too).
"""

from __future__ import annotations

from typing import Mapping

import torch

from weight_sync.spec import RankShards
from weight_sync.wire import (BLOCK, SCALE_SUFFIXES, BlockSplit, WireFormat, blocks, is_quantized,  # noqa: F401
                              quantized_buffers, scale_shape, sent_buffers, unscaled, wire_spec)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
INT8_MAX = 127.0  # symmetric: -128 is never used
TINY = 1e-12  # a zero block's stand-in for its largest magnitude


def torch_dtype(fmt: WireFormat) -> torch.dtype:
    """The torch dtype the tensors a format keeps plain travel as."""
    return getattr(torch, fmt.dtype)


def values_dtype(fmt: WireFormat) -> torch.dtype:
    """The torch dtype of a format's quantized values (float8_e4m3fn, int8)."""
    return getattr(torch, fmt.values)


def _padded(w: torch.Tensor, block: int) -> torch.Tensor:
    """`w` as fp32 with its last two dims zero-padded to whole blocks (zeros never raise a block's largest
    magnitude)."""
    w = w.float()
    n, k = w.shape[-2:]
    pn, pk = blocks(n, block) * block - n, blocks(k, block) * block - k
    return torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w


@torch.no_grad()
def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, scales)`: `w` ([..., N, K], any float dtype) as float8_e4m3fn values of its shape and fp32
    `weight_scale_inv` of `scale_shape(w.shape)`. A block's largest magnitude is max(max, -min) (no |w| copy); the
    values are divided a few row blocks at a time into one reused buffer and written into the float8 output."""
    scale_shape(tuple(w.shape), block)  # refuses 1-dim tensors
    n, k = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    p = _padded(w, block)
    nb, kb = p.shape[-2] // block, p.shape[-1] // block
    tiles = p.reshape(-1, nb, block, kb, block)
    scales = torch.maximum(tiles.amax(dim=(-3, -1)), tiles.amin(dim=(-3, -1)).neg_()).clamp_(min=TINY).div_(FP8_MAX)
    q = torch.empty(tiles.shape, dtype=FP8_DTYPE)
    step = max(1, (1 << 20) // (block * kb * block))  # row blocks a chunk: about 1 M elements
    buf = torch.empty((min(step, nb), block, kb, block))
    for i in range(tiles.shape[0]):
        for j in range(0, nb, step):
            m = min(step, nb - j)
            out = buf[:m]
            torch.div(tiles[i, j:j + m], scales[i, j:j + m].reshape(m, 1, kb, 1), out=out)
            q[i, j:j + m].copy_(out.clamp_(-FP8_MAX, FP8_MAX))
    q = q.reshape(*lead, nb * block, kb * block)
    if q.shape[-2:] != (n, k):
        q = q[..., :n, :k].contiguous()
    return q, scales.reshape(*lead, nb, kb)


@torch.no_grad()
def dequantize_fp8_block(q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q * scale` per block, as `dtype` (the weight the engine's kernels compute with)."""
    n, k = q.shape[-2:]
    full = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return (q.float() * full).to(dtype)


@torch.no_grad()
def quantize_int8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, scales)`: `w` ([..., N, K], any float dtype) as int8 values of its shape and fp32 `weight_scale`
    [..., N, 1], a row at a time in chunks of about 1 M elements (no fp32 copy of the whole tensor)."""
    if w.dim() < 2:
        raise ValueError(f"channel quantization needs a weight of at least 2 dims, not {tuple(w.shape)}")
    rows = w.reshape(-1, w.shape[-1])
    q = torch.empty(rows.shape, dtype=torch.int8)
    scales = torch.empty((rows.shape[0], 1), dtype=torch.float32)
    step = max(1, (1 << 20) // max(1, rows.shape[1]))
    buf = torch.empty((min(step, rows.shape[0]), rows.shape[1]))  # never w itself: the caller's weights stay
    for i in range(0, rows.shape[0], step):
        r = rows[i:i + step]
        s = torch.maximum(r.amax(dim=-1, keepdim=True), r.amin(dim=-1, keepdim=True).neg_()).float()
        s = s.clamp_(min=TINY).div_(INT8_MAX)
        scales[i:i + step] = s
        out = buf[:r.shape[0]]
        torch.div(r, s, out=out)
        q[i:i + step] = out.round_().clamp_(-INT8_MAX, INT8_MAX)
    return q.reshape(w.shape), scales.reshape(*w.shape[:-1], 1)


def quantize(w: torch.Tensor, fmt: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` quantized in `fmt` by the reference quantizer: `(values, scales)`."""
    return quantize_int8_channel(w) if fmt.per_channel else quantize_fp8_block(w, fmt.block)


@torch.no_grad()
def dequantize(q: torch.Tensor, scales: torch.Tensor, fmt: WireFormat, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """`q * scale` (per row or per block), as `dtype`."""
    if fmt.per_channel:
        return (q.float() * scales).to(dtype)
    return dequantize_fp8_block(q, scales, fmt.block, dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, its last dim counted in bytes (a view)."""
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


class OwnerWire(Mapping):
    """What an owner sends from: each of its buffers in wire form, as bytes, made the first time a transfer reads
    it (so quantizing the next buffers overlaps sending the first). A buffer of quantized weights is quantized
    whole (its blocks are its pieces' blocks: `wire_spec` checked that) into its values and a scale buffer; any
    other is cast to the plain dtype."""

    def __init__(self, buffers: Mapping[str, torch.Tensor], quantized: set[str], fmt: WireFormat):
        self._src, self._quantized, self._fmt = buffers, quantized, fmt
        self._names = [m for n in buffers for m in ((n, fmt.scale_name(n)) if n in quantized else (n,))]
        self._made: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        made = self._made.get(name)
        if made is not None:
            return made
        base = name if name in self._src else unscaled(name)
        if base not in self._src or (base != name and (base not in self._quantized or
                                                       name != self._fmt.scale_name(base))):
            raise KeyError(name)
        t = self._src[base]
        if base in self._quantized:
            q, s = quantize(t, self._fmt)
            self._made[base], self._made[self._fmt.scale_name(base)] = as_bytes(q), as_bytes(s)
        else:
            self._made[base] = as_bytes(t.to(torch_dtype(self._fmt)).contiguous())
        return self._made[name]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def owner_wire_buffers(buffers: Mapping[str, torch.Tensor], quantized: set[str], fmt: WireFormat) -> OwnerWire:
    """An owner's buffers in wire form (`OwnerWire`: each made when first read)."""
    return OwnerWire(buffers, quantized, fmt)


def typed_buffers(shapes: Mapping[str, tuple[int, ...]], quantized: set[str], fmt: WireFormat) -> dict[str, torch.Tensor]:
    """A receiver's buffers (zeros) in the engine's dtypes, for `shapes` (the typed spec's buffer shapes):
    quantized values and fp32 scales for the buffers in `quantized`, the plain dtype for the others. `as_bytes`
    of each is its wire buffer."""
    out = {}
    for name, shape in shapes.items():
        if name in quantized:
            out[name] = torch.zeros(shape, dtype=values_dtype(fmt))
            out[fmt.scale_name(name)] = torch.zeros(fmt.scale_shape(tuple(shape)), dtype=torch.float32)
        else:
            out[name] = torch.zeros(shape, dtype=torch_dtype(fmt))
    return out


def typed_views(wire: Mapping[str, torch.Tensor], typed: RankShards, fmt: WireFormat,
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A receiver's wire buffers (uint8, of `wire_spec`'s shapes) seen in the engine's dtypes and `typed`'s
    shapes (views: writing one writes the other): values, their scales, plain tensors."""
    quantized = quantized_buffers(typed, fmt, shapes)
    out = {}
    for name, shape in typed.buffers:
        if name in quantized:
            scales = fmt.scale_name(name)
            out[name] = wire[name].view(values_dtype(fmt)).view(shape)
            out[scales] = wire[scales].view(torch.float32).view(fmt.scale_shape(tuple(shape)))
        else:
            out[name] = wire[name].view(torch_dtype(fmt)).view(shape)
    return out


def nonfinite(typed: Mapping[str, torch.Tensor]) -> str | None:
    """The first buffer holding a value that is not finite (an fp32 / bf16 NaN or inf), or a scale that is not
    positive; None when every one is sound. What `run_plan`'s own check cannot see in bytes. Quantized values
    (float8, int8) are not scanned: a NaN or inf in a sender's weights makes its block's (row's) scale NaN or inf
    (the largest magnitude propagates it), and what the wire might flip the checksums catch."""
    from weight_sync.p2p import all_finite

    for name, t in typed.items():
        if t.dtype in (FP8_DTYPE, torch.int8):
            continue
        if name.endswith(SCALE_SUFFIXES):
            if not all_finite(t) or bool((t <= 0).any()):
                return name
        elif t.is_floating_point() and not all_finite(t):
            return name
    return None
