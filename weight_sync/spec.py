"""Shard specs: which box of which canonical (HF-named) global tensor each rank holds, and where.

Pure value objects, shared by both sides of a weight sync. A `Piece` says: rank r holds the region
`box` of global tensor `param`, stored in its local tensor `buffer` starting at `offset`. The region
occupies the buffer's last len(box.size) dims; any leading buffer dims have extent 1 there. So fused
buffers are several pieces in one buffer: vLLM's qkv_proj is three pieces (q, k, v rows of this TP
rank), a stacked expert buffer [E_local, 2I, H] is two pieces per local expert (gate at (j, 0, 0),
up at (j, I, 0)), a padded vocabulary is one piece that leaves the padding rows uncovered.

Ranks are ranks of the transfer world (trainer ranks and engine ranks numbered together by whoever
builds the specs); a spec lists only its own ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a tensor: `start` and `size` per dim."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    def __post_init__(self):
        if len(self.start) != len(self.size) or any(s < 0 for s in self.start) or any(n <= 0 for n in self.size):
            raise ValueError(f"invalid box start={self.start} size={self.size}")

    @staticmethod
    def full(shape: Shape) -> "Box":
        return Box(tuple(0 for _ in shape), tuple(shape))

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(a + n for a, n in zip(self.start, self.size))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= s
        return n

    def within(self, shape: Shape) -> bool:
        return len(shape) == len(self.size) and all(e <= s for e, s in zip(self.stop, shape))

    def intersect(self, other: "Box") -> "Box | None":
        lo = tuple(max(a, b) for a, b in zip(self.start, other.start))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        if any(h <= l for l, h in zip(lo, hi)):
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.size))


@dataclass(frozen=True)
class Piece:
    param: str  # canonical HF name of the global tensor
    box: Box  # region of the global tensor
    buffer: str  # local tensor that stores it
    offset: tuple[int, ...]  # where the region starts in the buffer (len == buffer ndim)

    def buffer_box(self) -> Box:
        """The region inside the buffer (leading extra dims have extent 1)."""
        lead = len(self.offset) - len(self.box.size)
        return Box(self.offset, (1,) * lead + self.box.size)

    def buffer_slices(self, sub: Box | None = None) -> tuple:
        """Index into the buffer for this piece, or for `sub` (a part of `box`), shaped like the box."""
        sub = sub or self.box
        lead = len(self.offset) - len(sub.size)
        idx = tuple(self.offset[:lead])  # integer indices drop the leading unit dims
        return idx + tuple(slice(o + (a - b), o + (a - b) + n) for o, a, b, n in
                           zip(self.offset[lead:], sub.start, self.box.start, sub.size))


@dataclass(frozen=True)
class RankShards:
    rank: int
    buffers: tuple[tuple[str, Shape], ...]  # (local tensor name, shape), in storage order
    pieces: tuple[Piece, ...]

    def buffer_shapes(self) -> dict[str, Shape]:
        return dict(self.buffers)


@dataclass(frozen=True)
class ShardSpec:
    name: str  # e.g. "trainer pp2xtp2" or "engine0 tp2"
    global_shapes: tuple[tuple[str, Shape], ...]  # canonical name -> global shape
    ranks: tuple[RankShards, ...]
    dtype: str = "float32"
    _index: dict = field(default=None, compare=False, hash=False, repr=False)

    def shapes(self) -> dict[str, Shape]:
        return dict(self.global_shapes)

    def rank_ids(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks)

    def pieces_of(self, param: str) -> list[tuple[int, Piece]]:
        """(rank, piece) for every piece of `param`, across ranks (built once, cached)."""
        if self._index is None:
            index: dict[str, list] = {}
            for r in self.ranks:
                for p in r.pieces:
                    index.setdefault(p.param, []).append((r.rank, p))
            object.__setattr__(self, "_index", index)
        return self._index.get(param, [])

    def validate(self, must_cover: bool) -> None:
        """Every piece lies inside its global tensor and its buffer; pieces of one rank do not overlap in
        a buffer; with `must_cover`, every element of every global tensor is held by some rank."""
        shapes = self.shapes()
        for r in self.ranks:
            bufs = r.buffer_shapes()
            used: dict[str, list[Box]] = {}
            for p in r.pieces:
                if p.param not in shapes:
                    raise ValueError(f"{self.name} rank {r.rank}: piece of unknown tensor {p.param!r}")
                if not p.box.within(shapes[p.param]):
                    raise ValueError(f"{self.name} rank {r.rank}: {p.param} box {p.box} outside {shapes[p.param]}")
                if p.buffer not in bufs:
                    raise ValueError(f"{self.name} rank {r.rank}: {p.param} stored in unknown buffer {p.buffer!r}")
                bb = p.buffer_box()
                if not bb.within(bufs[p.buffer]):
                    raise ValueError(f"{self.name} rank {r.rank}: {p.param} at {bb} outside buffer "
                                     f"{p.buffer} {bufs[p.buffer]}")
                for other in used.setdefault(p.buffer, []):
                    if other.intersect(bb) is not None:
                        raise ValueError(f"{self.name} rank {r.rank}: pieces overlap in buffer {p.buffer} at {bb}")
                used[p.buffer].append(bb)
        if must_cover:
            for name, shape in shapes.items():
                held = sum(p.box.numel for _, p in _unique_boxes(self.pieces_of(name)))
                total = Box.full(shape).numel
                if held < total:
                    raise ValueError(f"{self.name}: no rank holds part of {name} ({held} of {total} elements held)")


def _unique_boxes(pieces: Iterable[tuple[int, Piece]]) -> list[tuple[int, Piece]]:
    """One piece per distinct box (replicas collapsed). Only exact for specs whose boxes tile the tensor
    (replicas equal, no partial overlaps), which is what both sides produce."""
    seen: dict[Box, tuple[int, Piece]] = {}
    for rp in pieces:
        seen.setdefault(rp[1].box, rp)
    return list(seen.values())
