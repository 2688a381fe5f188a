"""Quantized syncs as bytes: which tensors the engines keep quantized (the rule, stated once), and the spec of
a sync on the wire. Pure (no torch): `rlhf plan` and config validation use it; the tensors' side, the reference
quantizer included, is `weight_sync.quant` (docs/quantized_rollout.md).

Two formats (`WireFormat.quantization`): `fp8_block` (float8_e4m3fn values, one fp32 scale a `block` x `block`
block of the last two dims, `<name>_scale_inv`: DeepSeek-V3's checkpoints, vLLM's `fp8` method) and `int8_channel`
(int8 values, one fp32 scale an output channel, i.e. a row of the last two dims, `<name>_scale` of shape
`[..., rows, 1]`: W8A8 with per-token activations, compressed-tensors' layout, vllm-ascend's native format).

`wire_spec`: a sync of quantized weights is planned and moved as bytes. Each tensor of a spec becomes its bytes in
the form the engines keep (a quantized weight: 1 byte an element; its scale tensor: a tensor of its own, 4 bytes a
block or a row; any other tensor: 2 bytes an element, bf16), each shape's last dim counted in bytes. The planner,
the transports and their checksums then run unchanged over one dtype (uint8), the plan's byte counts are the
wire's, and an owner sends the blocks it quantized from its own shard: nobody gathers anything. Every owner's
region of a quantized tensor must be whole blocks (fp8) or whole rows (int8: every input column) (`BlockSplit`
otherwise, naming the tensor and what to change): a block cut between two owners would need both to agree on its
scale, which this rule avoids rather than negotiates. A receiver may hold part of a row (an engine's row-parallel
TP shard): its scale tensor then holds the whole rows' scales, as vLLM keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from weight_sync.plan import DTYPE_BYTES
from weight_sync.spec import Box, Piece, RankShards, ShardSpec

BLOCK = 128


def blocks(n: int, block: int = BLOCK) -> int:
    """How many blocks cover `n` elements (the last one partial when `block` does not divide `n`)."""
    return -(-n // block)


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """The shape of `weight_scale_inv` for a weight of `shape` (at least 2 dims) in `block` x `block` blocks."""
    if len(shape) < 2:
        raise ValueError(f"block quantization needs a weight of at least 2 dims, not {tuple(shape)}")
    return tuple(shape[:-2]) + (blocks(shape[-2], block), blocks(shape[-1], block))


def channel_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of `weight_scale` for a weight of `shape` (at least 2 dims) with one scale a row."""
    if len(shape) < 2:
        raise ValueError(f"channel quantization needs a weight of at least 2 dims, not {tuple(shape)}")
    return tuple(shape[:-1]) + (1,)


# --- which tensors are quantized: the rule, stated once ---
# The linear layers' weights: attention projections (GQA and MLA), dense MLPs, shared and routed experts.
# Everything else stays bf16: embeddings, the LM head, norms, routers (`mlp.gate`, its correction bias), MTP's
# `eh_proj` (none of them is a linear layer vLLM's block-FP8 method serves, or they are too small to pay).
QUANTIZED_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
SCALE_SUFFIX = "_scale_inv"  # fp8_block's (vLLM's Fp8 method)
CHANNEL_SCALE_SUFFIX = "_scale"  # int8_channel's (compressed-tensors)
SCALE_SUFFIXES = (SCALE_SUFFIX, CHANNEL_SCALE_SUFFIX)


def is_quantized(param: str, shape: tuple[int, ...]) -> bool:
    """Whether `rollout.quantization` quantizes this canonical (HF-named) tensor."""
    parts = param.split(".")
    return len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS


def unscaled(name: str) -> str:
    """The weight (or buffer) a scale tensor's name belongs to; any other name as it is."""
    for suffix in SCALE_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return name


class BlockSplit(ValueError):
    """An owner's region of a quantized tensor is not made of whole blocks."""


QUANTIZATIONS = ("fp8_block", "int8_channel")


@dataclass(frozen=True)
class WireFormat:
    """How weights travel and are kept by the engines: `quantization` "none" (every tensor in `dtype`),
    "fp8_block" (`is_quantized` tensors as float8_e4m3fn blocks of `block` x `block` with fp32 scales) or
    "int8_channel" (int8 with one fp32 scale a row)."""

    quantization: str = "fp8_block"
    block: int = BLOCK
    dtype: str = "bfloat16"  # what the tensors that are not quantized travel as (a torch dtype's name)

    def __post_init__(self):
        if self.quantization not in ("none",) + QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r}: one of none, {', '.join(QUANTIZATIONS)}")
        if self.block <= 0:
            raise ValueError(f"block {self.block} must be positive")

    def quantized(self, param: str, shape: tuple[int, ...]) -> bool:
        return self.quantization != "none" and is_quantized(param, shape)

    @property
    def plain_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def per_channel(self) -> bool:
        return self.quantization == "int8_channel"

    @property
    def values(self) -> str:
        """The torch dtype's name of the quantized values."""
        return "int8" if self.per_channel else "float8_e4m3fn"

    def scale_name(self, name: str) -> str:
        """The scale tensor (or buffer) of a quantized weight (or of a buffer of them)."""
        return name + (CHANNEL_SCALE_SUFFIX if self.per_channel else SCALE_SUFFIX)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return channel_scale_shape(shape) if self.per_channel else scale_shape(shape, self.block)


def _bytes_box(box: Box, elem: int) -> Box:
    return Box(box.start[:-1] + (box.start[-1] * elem,), box.size[:-1] + (box.size[-1] * elem,))


def _bytes_offset(offset: tuple[int, ...], elem: int) -> tuple[int, ...]:
    return offset[:-1] + (offset[-1] * elem,)


def _bytes_shape(shape: tuple[int, ...], elem: int) -> tuple[int, ...]:
    return tuple(shape[:-1]) + (shape[-1] * elem,)


def _wire_shapes(name: str, shape: tuple[int, ...], quantized: bool, fmt: WireFormat) -> list[tuple]:
    """A tensor's (or buffer's) entries on the wire: itself in bytes, and a quantized one's scales after it."""
    if quantized:
        return [(name, tuple(shape)), (fmt.scale_name(name), _bytes_shape(fmt.scale_shape(shape), 4))]
    return [(name, _bytes_shape(shape, fmt.plain_bytes))]


def _check_rows(p: Piece, shape: tuple[int, ...], spec: ShardSpec, rank: int) -> None:
    """int8_channel, a sender: `p`'s region holds every column of its rows (the owner alone sets each row's
    scale)."""
    if p.box.start[-1] != 0 or p.box.size[-1] != shape[-1]:
        lo, hi = p.box.start[-1], p.box.start[-1] + p.box.size[-1]
        raise BlockSplit(
            f"{p.param}: {spec.name} rank {rank} holds columns [{lo}, {hi}) of {shape[-1]}, part of each row "
            f"(rollout.quantization=int8_channel needs every sending rank to hold whole rows, so that it alone sets "
            f"each row's scale). Train without splitting this tensor's input dimension (trainer.tp=1: use dp and "
            f"ep), or use rollout.quantization=fp8_block or none")


def _check_blocks(p: Piece, shape: tuple[int, ...], buffer_shape: tuple[int, ...], block: int, spec: ShardSpec,
                  rank: int) -> None:
    """`p`'s region is whole blocks of its tensor, placed on the block grid of its buffer, and a partial
    block at the tensor's edge ends at the buffer's edge (so the buffer's blocks are the tensor's)."""
    names = ("rows", "columns")
    for i, d in enumerate((-2, -1)):
        lo, n = p.box.start[d], p.box.size[d]
        hi, off = lo + n, p.offset[d]
        partial = hi % block != 0
        cut = lo % block or (partial and hi != shape[d])  # the owner's region starts or ends inside a block
        if cut:
            raise BlockSplit(
                f"{p.param}: {spec.name} rank {rank} holds {names[i]} [{lo}, {hi}) of {shape[d]}, which cuts its "
                f"{block} x {block} blocks (rollout.quantization=fp8_block needs every owner's region to be whole "
                f"blocks, so that the owner alone sets each block's scale). Shard this tensor in multiples of "
                f"{block} {names[i]} (fewer trainer.tp or zero-3 ranks, or a model whose dimensions are multiples "
                f"of {block} per shard), or use rollout.quantization=none")
        if off % block or (partial and off + n != buffer_shape[d]):  # whole, but off the buffer's block grid
            raise BlockSplit(
                f"{p.param}: its {shape[d]} {names[i]} are not whole {block} x {block} blocks, and {spec.name} rank "
                f"{rank} keeps it in buffer {p.buffer!r} beside another tensor (a fused or stacked layer), where its "
                f"last block would take the next tensor's {names[i]}: rollout.quantization=fp8_block needs a model "
                f"whose dimensions are multiples of {block} (configs/model/qwen3_moe_fp8_tiny.yaml is one), or use "
                f"rollout.quantization=none")


def wire_spec(spec: ShardSpec, fmt: WireFormat, sender: bool = True) -> ShardSpec:
    """`spec` in bytes on the wire (dtype uint8): every tensor of `spec` in the form the engines keep, plus a
    scale tensor (and, per buffer of quantized weights, a scale buffer) for each quantized weight. Raises
    `BlockSplit` when some rank's region of a quantized tensor is not whole blocks (fp8: either side), or, on the
    sending side (`sender`), not whole rows (int8); ValueError when a buffer mixes quantized and plain tensors."""
    shapes = spec.shapes()
    quant = {name for name, shape in shapes.items() if fmt.quantized(name, shape)}
    global_shapes = [e for name, shape in spec.global_shapes for e in _wire_shapes(name, shape, name in quant, fmt)]
    ranks = []
    done: dict[tuple[int, int], tuple] = {}  # replicas share their buffers and pieces: convert those once
    for r in spec.ranks:
        key = (id(r.buffers), id(r.pieces))
        if key not in done:
            done[key] = _wire_rank(r, spec, shapes, quant, fmt, sender)
        buffers, pieces = done[key]
        ranks.append(RankShards(r.rank, buffers, pieces))
    return ShardSpec(f"{spec.name} {fmt.quantization}", tuple(global_shapes), tuple(ranks), "uint8")


def _wire_rank(r: RankShards, spec: ShardSpec, shapes: dict, quant: set[str], fmt: WireFormat,
               sender: bool) -> tuple[tuple, tuple]:
    bufs = r.buffer_shapes()
    plain, b = fmt.plain_bytes, fmt.block
    kinds: dict[str, set[bool]] = {}
    for p in r.pieces:
        kinds.setdefault(p.buffer, set()).add(p.param in quant)
    mixed = sorted(n for n, k in kinds.items() if len(k) > 1)
    if mixed:
        raise ValueError(f"{spec.name} rank {r.rank}: buffer {mixed[0]!r} holds quantized and unquantized tensors; "
                         f"a buffer must be one or the other")
    qbufs = {n for n, k in kinds.items() if True in k}
    buffers = [e for name, shape in r.buffers for e in _wire_shapes(name, shape, name in qbufs, fmt)]
    pieces = []
    for p in r.pieces:
        if p.param not in quant:
            pieces.append(Piece(p.param, _bytes_box(p.box, plain), p.buffer, _bytes_offset(p.offset, plain)))
            continue
        pieces.append(p)
        if fmt.per_channel:  # the scales of its rows: the whole rows' (a receiver may hold part of them)
            if sender:
                _check_rows(p, shapes[p.param], spec, r.rank)
            start, size, offset = p.box.start[:-1] + (0,), p.box.size[:-1] + (1,), p.offset[:-1] + (0,)
        else:
            _check_blocks(p, shapes[p.param], bufs[p.buffer], b, spec, r.rank)
            start = p.box.start[:-2] + tuple(a // b for a in p.box.start[-2:])
            size = p.box.size[:-2] + tuple(blocks(a + n, b) - a // b for a, n in zip(p.box.start[-2:], p.box.size[-2:]))
            offset = p.offset[:-2] + tuple(o // b for o in p.offset[-2:])
        pieces.append(Piece(fmt.scale_name(p.param), _bytes_box(Box(start, size), 4), fmt.scale_name(p.buffer),
                            _bytes_offset(offset, 4)))
    return tuple(buffers), tuple(pieces)


def quantized_buffers(shards: RankShards, fmt: WireFormat, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The buffers of a rank that hold quantized weights."""
    return {p.buffer for p in shards.pieces if fmt.quantized(p.param, shapes[p.param])}


_SENT: dict[int, tuple] = {}  # rank -> (plan, the typed buffers it reads there): plans are cached, few per run


def sent_buffers(plan, rank: int) -> frozenset[str]:
    """The (typed) buffers rank `rank` sends from in a wire plan: a scale buffer counts as its weights'. A DP
    replica quantizes only those (the planner shares a replicated tensor's sending among its holders)."""
    cached = _SENT.get(rank)
    if cached is None or cached[0] is not plan:
        cached = _SENT[rank] = (plan, frozenset(unscaled(t.src_buffer) for (s, _), ts in plan.pairs
                                                if s == rank for t in ts))
    return cached[1]
