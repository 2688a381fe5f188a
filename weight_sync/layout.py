"""Parallel layouts: named degrees, rank <-> coordinates, and the groups of each axis. Pure.

A training layout has the mesh axes `pp` (outermost), `dp`, `tp` (innermost: the ranks of one TP
group are adjacent, so they sit on one node). World size is pp * dp * tp.

Expert parallelism is carved out of the dp x tp ranks of each pipeline stage and does not add to
the world size. Number the ranks of a stage by f = dp_index * tp + tp_index (TP fastest); an EP group
is a block of `expert_shards` consecutive f, so EP takes the ranks of a TP group first, then DP
ranks. `expert_shards` is `ep`, or `ep * tp` when experts are split over TP x EP. Ranks with the
same position in different EP groups hold the same experts (the expert-replica group).

`to_device_mesh` is the only torch call, imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    experts_over_tp_ep: bool = False

    def __post_init__(self):
        for name in ("pp", "dp", "tp", "ep"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"layout {name}={getattr(self, name)!r}: every degree must be an integer >= 1")
        if self.plane % self.expert_shards:
            what = f"ep * tp = {self.ep} * {self.tp}" if self.experts_over_tp_ep else f"ep = {self.ep}"
            raise ValueError(
                f"layout {self}: {what} = {self.expert_shards} ranks per expert group must divide the dp * tp = "
                f"{self.dp} * {self.tp} = {self.plane} ranks of a pipeline stage (EP is carved out of them); "
                f"change ep, dp or tp")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def plane(self) -> int:
        """Ranks per pipeline stage (dp * tp)."""
        return self.dp * self.tp

    @property
    def expert_shards(self) -> int:
        """Ranks one EP group spreads the experts over."""
        return self.ep * self.tp if self.experts_over_tp_ep else self.ep

    def __str__(self) -> str:
        parts = [f"{a}{getattr(self, a)}" for a in ("pp", "dp", "tp", "ep") if getattr(self, a) > 1] or ["single"]
        return "x".join(parts) + ("(experts over tp x ep)" if self.experts_over_tp_ep else "")

    # --- rank <-> coordinates ---
    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside layout {self} of {self.world_size} ranks")
        return Coords(pp=rank // self.plane, dp=(rank % self.plane) // self.tp, tp=rank % self.tp)

    def rank(self, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        if not (0 <= pp < self.pp and 0 <= dp < self.dp and 0 <= tp < self.tp):
            raise ValueError(f"coordinates pp={pp} dp={dp} tp={tp} outside layout {self}")
        return (pp * self.dp + dp) * self.tp + tp

    # --- groups ---
    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """The ranks that differ from `rank` only along `axis` (pp, dp or tp), in axis order."""
        c = self.coords(rank)
        if axis == "pp":
            return tuple(self.rank(i, c.dp, c.tp) for i in range(self.pp))
        if axis == "dp":
            return tuple(self.rank(c.pp, i, c.tp) for i in range(self.dp))
        if axis == "tp":
            return tuple(self.rank(c.pp, c.dp, i) for i in range(self.tp))
        raise ValueError(f"unknown axis {axis!r}; use one of {AXES} (or ep_group / expert_replica_group)")

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group along `axis`, each once, ordered by their first rank."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self._named_group(r, axis), None)
        return tuple(seen)

    def axis_group(self, rank: int, axis: str) -> tuple[int, ...]:
        """`rank`'s group along any axis: pp, dp, tp, ep, expert_replica or stage."""
        return self._named_group(rank, axis)

    def _named_group(self, rank: int, axis: str) -> tuple[int, ...]:
        return {"ep": self.ep_group, "expert_replica": self.expert_replica_group, "stage": self.stage_group}.get(
            axis, lambda r: self.group(r, axis))(rank)

    def stage_group(self, rank: int) -> tuple[int, ...]:
        """All dp x tp ranks of this rank's pipeline stage."""
        first = self.coords(rank).pp * self.plane
        return tuple(range(first, first + self.plane))

    def ep_index(self, rank: int) -> int:
        """Position of `rank` within its EP group: which expert shard it holds."""
        return (rank % self.plane) % self.expert_shards

    def ep_group(self, rank: int) -> tuple[int, ...]:
        f = rank % self.plane
        first = rank - f + (f // self.expert_shards) * self.expert_shards
        return tuple(range(first, first + self.expert_shards))

    def expert_replica_group(self, rank: int) -> tuple[int, ...]:
        """Ranks of the same stage holding the same experts (one per EP group)."""
        stage_first = self.coords(rank).pp * self.plane
        return tuple(range(stage_first + self.ep_index(rank), stage_first + self.plane, self.expert_shards))

    # --- what each rank holds ---
    def experts(self, rank: int, num_experts: int, expert_map: Sequence[int] | None = None) -> tuple[int, ...]:
        """Global expert ids held by `rank`. `expert_map[e]` = the shard holding expert e; by default
        experts are split contiguously. Any map with equal counts per shard is allowed."""
        emap = default_expert_map(num_experts, self.expert_shards) if expert_map is None else tuple(expert_map)
        check_expert_map(emap, num_experts, self.expert_shards)
        shard = self.ep_index(rank)
        return tuple(e for e in range(num_experts) if emap[e] == shard)

    def stage_layers(self, num_layers: int, split: Sequence[int] | None = None) -> tuple[range, ...]:
        """Layer ranges of each pipeline stage; `split` gives the layer count per stage (uneven allowed)."""
        if split is None:
            base, extra = divmod(num_layers, self.pp)
            split = [base + (1 if s < extra else 0) for s in range(self.pp)]
        if len(split) != self.pp or sum(split) != num_layers or min(split) < 1:
            raise ValueError(f"pipeline split {list(split)}: need {self.pp} stages of >= 1 layer summing to "
                             f"{num_layers}")
        out, start = [], 0
        for n in split:
            out.append(range(start, start + n))
            start += n
        return tuple(out)

    def to_device_mesh(self, device_type: str):
        """A torch DeviceMesh with dims (pp, dp, tp); the process group must be initialised."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=AXES)


def default_expert_map(num_experts: int, shards: int) -> tuple[int, ...]:
    if num_experts % shards:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {shards} expert shards; "
                         f"choose ep so that it divides the experts")
    per = num_experts // shards
    return tuple(e // per for e in range(num_experts))


def check_expert_map(emap: Sequence[int], num_experts: int, shards: int) -> None:
    if len(emap) != num_experts:
        raise ValueError(f"expert map has {len(emap)} entries for {num_experts} experts")
    counts = [0] * shards
    for e, s in enumerate(emap):
        if not 0 <= s < shards:
            raise ValueError(f"expert map sends expert {e} to shard {s}; shards are 0..{shards - 1}")
        counts[s] += 1
    if len(set(counts)) > 1:
        raise ValueError(f"expert map gives shards unequal expert counts {counts}; stacked expert buffers need equal ones")
