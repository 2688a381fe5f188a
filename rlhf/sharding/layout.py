"""Parallel layouts of the trainer and of the rollout engines, and the rules a model shape must meet
to be split by them. Pure: neither torch nor any transport; the trainer, the shard specs, the
resharding planner, placement and config validation all read layouts from here.

A training layout has the mesh axes `pp` (outermost), `dp`, `tp` (innermost: the ranks of one TP
group are adjacent, so they sit on one node). World size is pp * dp * tp.

Expert parallelism is carved out of the dp x tp ranks of each pipeline stage and does not add to
the world size. Number the ranks of a stage by f = dp_index * tp + tp_index (TP fastest); an EP group
is a block of `expert_shards` consecutive f, so EP takes the ranks of a TP group first, then DP
ranks. `expert_shards` is `ep`, or `ep * tp` when experts are split over TP x EP. Ranks with the
same position in different EP groups hold the same experts (the expert-replica group).

An engine (`InferenceLayout`) has W ranks: W = tp when ep == 1, else W = ep (ep a multiple of tp). With
ep > tp it runs vLLM's data-parallel attention over ep / tp groups of tp ranks; experts are split over
all W ranks (whole experts), or, with ep == 1, every rank holds every expert with its FFN dim split over tp.

`fit_problems` states once what a model shape needs from tp and ep (heads, KV heads, FFN sizes, experts,
padded vocabulary); config validation reports its problems, shard specs raise the first one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlhf.errors import Problem, divisors
from rlhf.schema import Attention, ModelConfig, RolloutConfig, TrainerConfig

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


@dataclass(frozen=True)
class InferenceLayout:
    """Degrees of each rollout engine (tp, ep) and how many engines there are."""

    tp: int
    ep: int = 1
    engines: int = 1
    redundant_experts: int = 0  # vLLM EPLB's num_redundant_experts: extra physical experts per engine

    def __post_init__(self):
        for name in ("tp", "ep", "engines"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"inference layout {name}={v!r}: every degree must be an integer >= 1")
        r = self.redundant_experts
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"inference layout redundant_experts={r!r}: must be an integer >= 0")
        if r and self.ep == 1:
            raise ValueError(f"inference layout redundant_experts={r} with ep=1: redundant experts replicate "
                             f"experts across expert-parallel ranks; set ep > 1 or redundant_experts=0")
        if self.ep > 1 and self.ep % self.tp:
            raise ValueError(f"inference layout tp={self.tp} ep={self.ep}: ep must be 1 or a multiple of tp "
                             f"(ep > tp runs data-parallel attention over ep / tp groups of tp ranks); "
                             f"change ep or tp")

    @property
    def ranks_per_engine(self) -> int:
        return self.tp if self.ep == 1 else self.ep

    @property
    def world_size(self) -> int:
        return self.ranks_per_engine * self.engines

    @property
    def attention_dp(self) -> int:
        """Data-parallel attention groups per engine."""
        return self.ranks_per_engine // self.tp

    def __str__(self) -> str:
        return (f"{self.engines}x(tp{self.tp}" + (f"ep{self.ep}" if self.ep > 1 else "")
                + (f"r{self.redundant_experts}" if self.redundant_experts else "") + ")")


def trainer_layout(t: TrainerConfig) -> Layout:
    """The training layout a trainer config describes (raises ValueError naming the clashing degrees)."""
    return Layout(pp=t.pp, dp=t.dp, tp=t.tp, ep=t.ep, experts_over_tp_ep=t.experts_over_tp_ep)


def inference_layout(r: RolloutConfig) -> InferenceLayout:
    """The engines' layout a rollout config describes."""
    return InferenceLayout(tp=r.tp, ep=r.ep, engines=r.num_engines)


# --- what a model shape needs from a layout ---

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary as vLLM pads it (a multiple of 64), which must split over tp."""
    vp = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    if vp % tp:
        raise ValueError(f"vocabulary {vocab_size} padded to {vp} (a multiple of {VOCAB_PADDING}, as vLLM pads it) "
                         f"does not split over tp={tp}; choose tp dividing {vp}")
    return vp


def fit_problems(m: ModelConfig, section: str, tp: int, ep: int, experts_over_tp_ep: bool = False,
                 engine: bool = False, redundant_experts: int = 0) -> list[Problem]:
    """What the model shape `m` needs from a layout's tp and ep, each problem keyed `section.tp` or
    `section.ep`. Trainer (`engine=False`): experts split whole over ep (or ep * tp); engines: whole
    experts over ep when ep > 1, else every expert with its FFN dim split over tp, and the padded
    vocabulary split over tp."""
    if tp <= 0 or ep <= 0:
        return [Problem(f"{section}.{'tp' if tp <= 0 else 'ep'}", tp if tp <= 0 else ep, "must be >= 1")]
    p: list[Problem] = []
    tkey, ekey = f"{section}.tp", f"{section}.ep"
    N, K = m.num_attention_heads, m.num_key_value_heads
    if N % tp:
        p.append(Problem(tkey, tp, f"tp={tp} must divide the {N} attention heads (model.num_attention_heads={N}); "
                                   f"choose one of {divisors(N)}"))
    if m.attention is Attention.gqa and K % tp and tp % K:
        p.append(Problem(tkey, tp, f"must divide or be a multiple of model.num_key_value_heads={K} (KV heads are "
                                   f"split or replicated)"))
    if m.first_k_dense_layers and m.intermediate_size % tp:
        p.append(Problem(tkey, tp, f"must divide model.intermediate_size={m.intermediate_size} (dense-first MLPs "
                                   f"are split over tp)"))
    shared = m.num_shared_experts * m.shared_expert_intermediate_size
    if shared and shared % tp:
        p.append(Problem(tkey, tp, f"must divide the shared experts' intermediate size {shared}"))
    E = m.num_experts
    if engine and ep == 1:
        if m.moe_intermediate_size % tp:
            p.append(Problem(tkey, tp, f"must divide model.moe_intermediate_size={m.moe_intermediate_size} "
                                       f"(with ep=1 every engine rank holds every expert, split over tp)"))
    else:
        shards = ep * tp if experts_over_tp_ep else ep
        slots = E + redundant_experts
        if slots % shards:
            what = f"ep * tp = {ep} * {tp}" if experts_over_tp_ep else f"ep={ep}"
            held = (f"the {E} + {redundant_experts} redundant = {slots} physical experts" if redundant_experts
                    else f"the {E} experts")
            p.append(Problem(ekey, ep, f"{what} must divide {held} (model.num_experts={E}); choose ep so that it "
                                       f"does, e.g. one of {divisors(slots)}"))
    if engine:
        try:
            padded_vocab(m.vocab_size, tp)
        except ValueError as e:
            p.append(Problem(tkey, tp, str(e)))
    return p
