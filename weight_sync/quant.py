"""Low-precision formats of rollout weights, and the reference quantizer every copy of them is checked against.

`fp8_block` (`rollout.quantization`, docs/quantized_rollout.md): the layout of DeepSeek-V3's own checkpoints and
of vLLM's block-FP8 kernels. A weight `[..., N, K]` is cut into 128 x 128 blocks of its last two dims (the
blocks at the far edges may be partial); each block keeps one fp32 scale, `weight_scale_inv[..., N/128, K/128]`
(rounded up), the block's largest magnitude over 448 (float8_e4m3fn's largest finite value), and its values
`float8_e4m3fn(w / scale)`. Dequantized, `w ~ q * scale`. An all-zero block gets the scale of a block whose
largest magnitude is `TINY` (its values stay 0, so nothing divides by zero).

The maths is per block and per element: quantizing a block-aligned region of a tensor gives exactly the
values and scales that quantizing the whole tensor gives there (the tests hold the quantizer to that, and
the owners of a tensor's regions rely on it: each quantizes the blocks it holds).

**On the wire** (`wire_spec`): a sync of quantized weights is planned and moved as bytes. Each tensor of a
spec becomes its bytes in the form the engines keep (a quantized weight: 1 byte an element; its
`<name>_scale_inv`: a tensor of its own, 4 bytes a block; any other tensor: 2 bytes an element, bf16), each
shape's last dim counted in bytes. The planner, the transports and their checksums then run unchanged over
one dtype (uint8), the plan's byte counts are the wire's, and an owner sends the blocks it quantized from its
own shard: nobody gathers anything. Every owner's region of a quantized tensor must be whole blocks
(`BlockSplit` otherwise, naming the tensor and what to change): a block cut between two owners would need
both to agree on its scale, which this rule avoids rather than negotiates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from weight_sync.spec import Box, Piece, RankShards, ShardSpec

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128
TINY = 1e-12  # a zero block's stand-in for its largest magnitude


def blocks(n: int, block: int = BLOCK) -> int:
    """How many blocks cover `n` elements (the last one partial when `block` does not divide `n`)."""
    return -(-n // block)


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """The shape of `weight_scale_inv` for a weight of `shape` (at least 2 dims)."""
    if len(shape) < 2:
        raise ValueError(f"block quantization needs a weight of at least 2 dims, not {tuple(shape)}")
    return tuple(shape[:-2]) + (blocks(shape[-2], block), blocks(shape[-1], block))


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
    values are divided a few row blocks at a time into one reused buffer and written into the float8 output
    (about 3 ns an element on one core here, a third of the plain vectorized form)."""
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


# --- which tensors are quantized: the rule, stated once ---

# The linear layers' weights: attention projections (GQA and MLA), dense MLPs, shared and routed experts.
# Everything else stays bf16: embeddings, the LM head, norms, routers (`mlp.gate`, its correction bias), MTP's
# `eh_proj` (none of them is a linear layer vLLM's block-FP8 method serves, or they are too small to pay).
QUANTIZED_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"})
SCALE_SUFFIX = "_scale_inv"


def is_quantized(param: str, shape: tuple[int, ...]) -> bool:
    """Whether `rollout.quantization` quantizes this canonical (HF-named) tensor."""
    parts = param.split(".")
    return len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS


def scale_name(name: str) -> str:
    """The scale tensor (or buffer) of a quantized weight (or of a buffer of them): `...weight_scale_inv`."""
    return name + SCALE_SUFFIX


class BlockSplit(ValueError):
    """An owner's region of a quantized tensor is not made of whole blocks."""


@dataclass(frozen=True)
class WireFormat:
    """How weights travel and are kept by the engines: `quantization` "none" (every tensor in `dtype`) or
    "fp8_block" (`is_quantized` tensors as float8_e4m3fn blocks of `block` x `block` with fp32 scales)."""

    quantization: str = "fp8_block"
    block: int = BLOCK
    dtype: torch.dtype = torch.bfloat16  # what the tensors that are not quantized travel as

    def __post_init__(self):
        if self.quantization not in ("none", "fp8_block"):
            raise ValueError(f"quantization {self.quantization!r}: one of none, fp8_block")
        if self.block <= 0:
            raise ValueError(f"block {self.block} must be positive")

    def quantized(self, param: str, shape: tuple[int, ...]) -> bool:
        return self.quantization != "none" and is_quantized(param, shape)

    @property
    def plain_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _bytes_box(box: Box, elem: int) -> Box:
    return Box(box.start[:-1] + (box.start[-1] * elem,), box.size[:-1] + (box.size[-1] * elem,))


def _bytes_offset(offset: tuple[int, ...], elem: int) -> tuple[int, ...]:
    return offset[:-1] + (offset[-1] * elem,)


def _bytes_shape(shape: tuple[int, ...], elem: int) -> tuple[int, ...]:
    return tuple(shape[:-1]) + (shape[-1] * elem,)


def _check_blocks(p: Piece, shape: tuple[int, ...], buffer_shape: tuple[int, ...], block: int, spec: ShardSpec,
                  rank: int) -> None:
    """`p`'s region is whole blocks of its tensor, placed on the block grid of its buffer, and a partial
    block at the tensor's edge ends at the buffer's edge (so the buffer's blocks are the tensor's)."""
    names = ("rows", "columns")
    for i, d in enumerate((-2, -1)):
        lo, n = p.box.start[d], p.box.size[d]
        hi, off = lo + n, p.offset[d]
        partial = hi % block != 0
        if not (lo % block or (partial and hi != shape[d])) and (off % block or (partial and off + n != buffer_shape[d])):
            raise BlockSplit(
                f"{p.param}: its {shape[d]} {names[i]} are not whole {block} x {block} blocks, and {spec.name} rank "
                f"{rank} keeps it in buffer {p.buffer!r} beside another tensor (a fused or stacked layer), where its "
                f"last block would take the next tensor's {names[i]}: rollout.quantization=fp8_block needs a model "
                f"whose dimensions are multiples of {block} (configs/model/qwen3_moe_fp8_tiny.yaml is one), or use "
                f"rollout.quantization=none")
        if lo % block or (partial and hi != shape[d]) or off % block or (partial and off + n != buffer_shape[d]):
            raise BlockSplit(
                f"{p.param}: {spec.name} rank {rank} holds {names[i]} [{lo}, {hi}) of {shape[d]}, which cuts its "
                f"{block} x {block} blocks (rollout.quantization=fp8_block needs every owner's region to be whole "
                f"blocks, so that the owner alone sets each block's scale). Shard this tensor in multiples of "
                f"{block} {names[i]} (fewer trainer.tp or zero-3 ranks, or a model whose dimensions are multiples "
                f"of {block} per shard), or use rollout.quantization=none")


def wire_spec(spec: ShardSpec, fmt: WireFormat) -> ShardSpec:
    """`spec` in bytes on the wire (dtype uint8): every tensor of `spec` in the form the engines keep, plus a
    scale tensor (and, per buffer of quantized weights, a scale buffer) for each quantized weight. Raises
    `BlockSplit` when some rank's region of a quantized tensor is not whole blocks, ValueError when a buffer
    mixes quantized and plain tensors."""
    shapes = spec.shapes()
    plain, b = fmt.plain_bytes, fmt.block
    quant = {name for name, shape in shapes.items() if fmt.quantized(name, shape)}
    global_shapes = []
    for name, shape in spec.global_shapes:
        if name in quant:
            global_shapes += [(name, tuple(shape)), (scale_name(name), _bytes_shape(scale_shape(shape, b), 4))]
        else:
            global_shapes.append((name, _bytes_shape(shape, plain)))
    ranks = []
    done: dict[tuple[int, int], tuple] = {}  # replicas share their buffers and pieces: convert those once
    for r in spec.ranks:
        key = (id(r.buffers), id(r.pieces))
        if key not in done:
            done[key] = _wire_rank(r, spec, shapes, quant, plain, b)
        buffers, pieces = done[key]
        ranks.append(RankShards(r.rank, buffers, pieces))
    return ShardSpec(f"{spec.name} {fmt.quantization}", tuple(global_shapes), tuple(ranks), "uint8")


def _wire_rank(r: RankShards, spec: ShardSpec, shapes: dict, quant: set[str], plain: int,
               b: int) -> tuple[tuple, tuple]:
    bufs = r.buffer_shapes()
    kinds: dict[str, set[bool]] = {}
    for p in r.pieces:
        kinds.setdefault(p.buffer, set()).add(p.param in quant)
    mixed = sorted(n for n, k in kinds.items() if len(k) > 1)
    if mixed:
        raise ValueError(f"{spec.name} rank {r.rank}: buffer {mixed[0]!r} holds quantized and unquantized tensors; "
                         f"a buffer must be one or the other")
    qbufs = {n for n, k in kinds.items() if True in k}
    buffers = []
    for name, shape in r.buffers:
        if name in qbufs:
            buffers += [(name, tuple(shape)), (scale_name(name), _bytes_shape(scale_shape(shape, b), 4))]
        else:
            buffers.append((name, _bytes_shape(shape, plain)))
    pieces = []
    for p in r.pieces:
        if p.param not in quant:
            pieces.append(Piece(p.param, _bytes_box(p.box, plain), p.buffer, _bytes_offset(p.offset, plain)))
            continue
        _check_blocks(p, shapes[p.param], bufs[p.buffer], b, spec, r.rank)
        pieces.append(p)
        start = p.box.start[:-2] + tuple(a // b for a in p.box.start[-2:])
        size = p.box.size[:-2] + tuple(blocks(a + n, b) - a // b for a, n in zip(p.box.start[-2:], p.box.size[-2:]))
        offset = p.offset[:-2] + tuple(o // b for o in p.offset[-2:])
        pieces.append(Piece(scale_name(p.param), _bytes_box(Box(start, size), 4), scale_name(p.buffer),
                            _bytes_offset(offset, 4)))
    return tuple(buffers), tuple(pieces)


def quantized_buffers(shards: RankShards, fmt: WireFormat, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The buffers of a rank that hold quantized weights."""
    return {p.buffer for p in shards.pieces if fmt.quantized(p.param, shapes[p.param])}


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, its last dim counted in bytes (a view)."""
    return t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


_SENT: dict[int, tuple] = {}  # rank -> (plan, the typed buffers it reads there): plans are cached, few per run


def sent_buffers(plan, rank: int) -> frozenset[str]:
    """The (typed) buffers rank `rank` sends from in a wire plan: a scale buffer counts as its weights'. A DP
    replica quantizes only those (the planner shares a replicated tensor's sending among its holders)."""
    cached = _SENT.get(rank)
    if cached is None or cached[0] is not plan:
        cached = _SENT[rank] = (plan, frozenset(t.src_buffer.removesuffix(SCALE_SUFFIX) for (s, _), ts in plan.pairs
                                                if s == rank for t in ts))
    return cached[1]


class OwnerWire(Mapping):
    """What an owner sends from: each of its buffers in wire form, as bytes, made the first time a transfer reads
    it (so quantizing the next buffers overlaps sending the first). A buffer of quantized weights is quantized
    whole (its blocks are its pieces' blocks: `wire_spec` checked that) into its values and a scale buffer; any
    other is cast to the plain dtype."""

    def __init__(self, buffers: Mapping[str, torch.Tensor], quantized: set[str], fmt: WireFormat):
        self._src, self._quantized, self._fmt = buffers, quantized, fmt
        self._names = [m for n in buffers for m in ((n, scale_name(n)) if n in quantized else (n,))]
        self._made: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        made = self._made.get(name)
        if made is not None:
            return made
        base = name if name in self._src else name.removesuffix(SCALE_SUFFIX)
        if base not in self._src or (base != name and base not in self._quantized):
            raise KeyError(name)
        t = self._src[base]
        if base in self._quantized:
            q, s = quantize_fp8_block(t, self._fmt.block)
            self._made[base], self._made[scale_name(base)] = as_bytes(q), as_bytes(s)
        else:
            self._made[base] = as_bytes(t.to(self._fmt.dtype).contiguous())
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
    float8 values and fp32 scales for the buffers in `quantized`, the plain dtype for the others. `as_bytes`
    of each is its wire buffer."""
    out = {}
    for name, shape in shapes.items():
        if name in quantized:
            out[name] = torch.zeros(shape, dtype=FP8_DTYPE)
            out[scale_name(name)] = torch.zeros(scale_shape(tuple(shape), fmt.block), dtype=torch.float32)
        else:
            out[name] = torch.zeros(shape, dtype=fmt.dtype)
    return out


def typed_views(wire: Mapping[str, torch.Tensor], typed: RankShards, fmt: WireFormat,
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A receiver's wire buffers (uint8, of `wire_spec`'s shapes) seen in the engine's dtypes and `typed`'s
    shapes (views: writing one writes the other): values, `..._scale_inv` scales, plain tensors."""
    quantized = quantized_buffers(typed, fmt, shapes)
    out = {}
    for name, shape in typed.buffers:
        if name in quantized:
            out[name] = wire[name].view(FP8_DTYPE).view(shape)
            out[scale_name(name)] = wire[scale_name(name)].view(torch.float32).view(scale_shape(tuple(shape), fmt.block))
        else:
            out[name] = wire[name].view(fmt.dtype).view(shape)
    return out


def nonfinite(typed: Mapping[str, torch.Tensor]) -> str | None:
    """The first buffer holding a value that is not finite (an fp32 / bf16 NaN or inf), or a scale that is not
    positive; None when every one is sound. What `run_plan`'s own check cannot see in bytes. float8 values are
    not scanned: a NaN or inf in a sender's weights makes its block's scale NaN or inf (the largest magnitude
    propagates it), and what the wire might flip the checksums catch."""
    from weight_sync.p2p import all_finite

    for name, t in typed.items():
        if t.dtype == FP8_DTYPE:
            continue
        if name.endswith(SCALE_SUFFIX):
            if not all_finite(t) or bool((t <= 0).any()):
                return name
        elif t.is_floating_point() and not all_finite(t):
            return name
    return None


def checkpoint_quantization(cfg_layers: int, fmt: WireFormat) -> dict:
    """The `quantization_config` of an HF config.json for weights in `fmt` (vLLM's `fp8` method with DeepSeek-V3's
    block layout); the routers, which vLLM's Qwen3-MoE would otherwise quantize, are named as kept."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [fmt.block, fmt.block],
            "ignored_layers": [f"model.layers.{layer}.mlp.gate" for layer in range(cfg_layers)]}


def write_quantized_checkpoint(src_dir, out_dir, fmt: WireFormat) -> str:
    """An HF model directory holding `src_dir`'s weights in `fmt` (what fp8 engines start from): each quantized
    tensor by the reference quantizer, with its `_scale_inv`, every other in the plain dtype; config.json gains
    the quantization; tokenizer and generation files copied. Written to a temporary directory, then renamed."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from rlhf.model.hf_io import iter_safetensors

    src, out = Path(src_dir), Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {}
    for name, t in iter_safetensors(src):
        if fmt.quantized(name, tuple(t.shape)):
            q, s = quantize_fp8_block(t, fmt.block)
            tensors[name], tensors[scale_name(name)] = q, s
        else:
            tensors[name] = t.to(fmt.dtype).contiguous()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = checkpoint_quantization(config["num_hidden_layers"], fmt)
    config["torch_dtype"] = str(fmt.dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():  # tokenizer, generation config
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model") \
                and f.suffix in (".json", ".txt", ".model", ".jinja"):
            shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return str(out)
