"""Between whole tensors and the buffers that hold their pieces (`weight_sync.spec.Piece`): fill a rank's
buffers from whole tensors, or assemble whole tensors from the pieces that buffers hold. The one place
this is written; the trainer's loading, checkpoint export, the engines' install and the tests use it.

Where a piece's data comes from is a function of the piece (`region`), so the source can be a dict of
tensors, a safetensors file read slice by slice, or received buffers.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, MutableMapping

import torch

from weight_sync.spec import Piece, Shape

Region = Callable[[Piece], torch.Tensor]


def fill_buffers(pieces: Iterable[Piece], buffer_shapes: Mapping[str, Shape], region: Region,
                 out: MutableMapping[str, torch.Tensor] | None = None) -> MutableMapping[str, torch.Tensor]:
    """Buffers of `buffer_shapes` holding each piece's box, `region(piece)` being that box of its whole
    tensor. Buffers are created on first use (dtype of the first region) unless `out` holds them."""
    out = {} if out is None else out
    for p in pieces:
        part = region(p)
        if p.buffer not in out:
            out[p.buffer] = torch.empty(buffer_shapes[p.buffer], dtype=part.dtype)
        out[p.buffer][p.buffer_slices()] = part
    return out


def assemble(pieces: Iterable[Piece], shapes: Mapping[str, Shape], region: Region,
             out: MutableMapping[str, torch.Tensor] | None = None) -> MutableMapping[str, torch.Tensor]:
    """Whole tensors of `shapes` assembled from pieces, `region(piece)` being the piece's region of its
    buffer. Tensors are created on first use (dtype of the first region) unless `out` holds them."""
    out = {} if out is None else out
    for p in pieces:
        part = region(p)
        if p.param not in out:
            out[p.param] = torch.empty(shapes[p.param], dtype=part.dtype)
        out[p.param][p.box.slices()] = part
    return out


def local_tensors(whole: Mapping[str, torch.Tensor], shards) -> dict[str, torch.Tensor]:
    """A rank's buffers sliced from whole tensors: `shards` has `pieces` and `buffer_shapes()` (a spec's
    `RankShards`, or the trainer's sharding of one rank). Every buffer is present (one no piece fills,
    such as a row shard with no rows, is empty)."""
    dtype = next(iter(whole.values())).dtype
    shapes = shards.buffer_shapes()
    out = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    return dict(fill_buffers(shards.pieces, shapes, lambda p: whole[p.param][p.box.slices()], out))


def buffer_region(buffers: Mapping[str, torch.Tensor]) -> Region:
    """`region` reading each piece from its buffer in `buffers` (for `assemble`)."""
    return lambda p: buffers[p.buffer][p.buffer_slices()]
