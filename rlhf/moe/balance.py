"""Expert-parallel load balancing (EDPB), its prediction and planning half. Pure: no torch.distributed.

RL changes the routing skew as the policy learns, so a static expert placement does not hold. Per MoE
layer the expected tokens of each expert are predicted by an exponential moving average of the loads
the trainer counts every optimizer step (`predict`, theta 0.9: the new load weighs 0.1). A layer's
placement is then planned greedily (`greedy_placement`: heaviest predicted expert first, to the EP
rank with the fewest predicted tokens that still has a free slot, so every rank keeps its E / ep
experts), its ranks relabelled to keep as many experts where they are as possible, and the layer
migrates only when the coefficient of variation of the predicted per-rank load (std / mean) drops by
at least `min_cv_drop` (`plan_layer`). The plan is data (`BalancePlan`): printed, logged, tested.

Expert maps are `expert -> EP rank` tuples, as `rlhf.sharding.layout.default_expert_map` makes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

Map = tuple[int, ...]


def predict(previous: Sequence[Sequence[float]] | None, loads: Sequence[Sequence[float]],
            theta: float = 0.9) -> list[list[float]]:
    """The next prediction of tokens per expert per MoE layer: theta * previous + (1 - theta) * loads; the
    first step's loads themselves."""
    if not 0 <= theta < 1:
        raise ValueError(f"theta={theta}: the moving average's weight on the past must be in [0, 1)")
    if previous is None:
        return [[float(x) for x in row] for row in loads]
    if len(previous) != len(loads) or any(len(p) != len(r) for p, r in zip(previous, loads)):
        raise ValueError("predict: the loads' [layers, experts] shape differs from the prediction's")
    return [[theta * p + (1 - theta) * x for p, x in zip(prow, row)] for prow, row in zip(previous, loads)]


def rank_loads(expert_load: Sequence[float], expert_map: Map, ep: int) -> list[float]:
    """Predicted tokens per EP rank: the sum of its experts' loads."""
    out = [0.0] * ep
    for e, r in enumerate(expert_map):
        out[r] += expert_load[e]
    return out


def coefficient_of_variation(values: Sequence[float]) -> float:
    """std / mean (population std); 0 for no load at all."""
    mean = sum(values) / len(values)
    if mean <= 0:
        return 0.0
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


def greedy_placement(expert_load: Sequence[float], ep: int) -> Map:
    """Experts by predicted load, heaviest first (ties: lower expert id), each to the rank with the fewest
    predicted tokens among those with a free slot (ties: lower rank); E / ep slots per rank."""
    E = len(expert_load)
    if ep < 1 or E % ep:
        raise ValueError(f"{E} experts cannot be split evenly over ep={ep} ranks")
    slots = E // ep
    load, used, out = [0.0] * ep, [0] * ep, [0] * E
    for e in sorted(range(E), key=lambda e: (-expert_load[e], e)):
        r = min((r for r in range(ep) if used[r] < slots), key=lambda r: (load[r], r))
        out[e], used[r], load[r] = r, used[r] + 1, load[r] + expert_load[e]
    return tuple(out)


def relabel(new_map: Map, current: Map, ep: int) -> Map:
    """The same grouping of experts with rank labels chosen to keep experts where they are: groups taken
    by their largest overlap with a current rank first (deterministic; ties by group, then rank)."""
    overlap = [[0] * ep for _ in range(ep)]  # [new group][current rank]
    for e, (g, r) in enumerate(zip(new_map, current)):
        overlap[g][r] += 1
    label: dict[int, int] = {}
    pairs = sorted(((overlap[g][r], g, r) for g in range(ep) for r in range(ep)), key=lambda t: (-t[0], t[1], t[2]))
    taken = set()
    for _, g, r in pairs:
        if g not in label and r not in taken:
            label[g] = r
            taken.add(r)
    return tuple(label[g] for g in new_map)


@dataclass(frozen=True)
class LayerPlan:
    layer: int  # index among the MoE layers
    current: Map
    proposed: Map  # the greedy placement, relabelled
    cv_before: float  # of the predicted per-rank load under the current map
    cv_after: float  # under the proposed one
    migrate: bool  # the drop reached min_cv_drop

    @property
    def new_map(self) -> Map:
        return self.proposed if self.migrate else self.current

    @property
    def moved(self) -> tuple[int, ...]:
        """Experts that change rank if the layer migrates."""
        return tuple(e for e, (a, b) in enumerate(zip(self.current, self.new_map)) if a != b)


def plan_layer(layer: int, expert_load: Sequence[float], current: Map, ep: int, min_cv_drop: float = 0.08) -> LayerPlan:
    """Whether and where one layer's experts move: the greedy placement, kept only if it lowers the predicted
    per-rank load's coefficient of variation by at least `min_cv_drop`."""
    if len(current) != len(expert_load):
        raise ValueError(f"layer {layer}: an expert map of {len(current)} experts for {len(expert_load)} loads")
    proposed = relabel(greedy_placement(expert_load, ep), current, ep)
    before = coefficient_of_variation(rank_loads(expert_load, current, ep))
    after = coefficient_of_variation(rank_loads(expert_load, proposed, ep))
    return LayerPlan(layer, tuple(current), proposed, before, after, before - after >= min_cv_drop)


@dataclass(frozen=True)
class BalancePlan:
    layers: tuple[LayerPlan, ...]

    @property
    def maps(self) -> tuple[Map, ...]:
        return tuple(p.new_map for p in self.layers)

    @property
    def experts_moved(self) -> int:
        return sum(len(p.moved) for p in self.layers)

    def metrics(self) -> dict[str, float]:
        """What the step logs: per layer the CV before and after, migrations, experts moved."""
        m: dict[str, float] = {}
        for p in self.layers:
            m[f"expert_balance/layer{p.layer}_cv_before"] = p.cv_before
            m[f"expert_balance/layer{p.layer}_cv_after"] = p.cv_after if p.migrate else p.cv_before
        m["expert_balance/layers_migrated"] = sum(p.migrate for p in self.layers)
        m["expert_balance/experts_moved"] = self.experts_moved
        return m

    def describe(self) -> str:
        lines = []
        for p in self.layers:
            what = f"migrate {len(p.moved)} experts" if p.migrate else "keep"
            lines.append(f"MoE layer {p.layer}: predicted per-rank load CV {p.cv_before:.3f} -> "
                         f"{p.cv_after:.3f} proposed: {what}")
        return "\n".join(lines)


def plan(prediction: Sequence[Sequence[float]], current: Sequence[Map], ep: int,
         min_cv_drop: float = 0.08) -> BalancePlan:
    """One `LayerPlan` per MoE layer from the predicted loads [layers, experts] and the current maps."""
    if len(prediction) != len(current):
        raise ValueError(f"{len(prediction)} layers of predictions for {len(current)} expert maps")
    return BalancePlan(tuple(plan_layer(i, row, m, ep, min_cv_drop) for i, (row, m) in enumerate(zip(prediction, current))))


def engine_placement(expert_load: Sequence[float], ep: int, redundant: int = 0) -> tuple[int, ...]:
    """One MoE layer's placement for an EP engine with `redundant` extra physical slots (vLLM EPLB's
    physical-to-logical map: slot p, on rank p // ((E + R) / ep), holds the logical expert it names). The extra
    slots go, one at a time, to the expert with the most predicted tokens per replica (the hottest experts are
    replicated, each replica serving an equal share, at most one per rank); then replicas, heaviest share first,
    each to the rank with the fewest predicted tokens among those with a free slot, preferring ranks without a replica.
    Slots are listed rank by rank, each rank's by expert id. Deterministic; the planner half of engines that follow
    the trainer's predictions (the engines do not take it yet: docs/expert_balance.md)."""
    E, R = len(expert_load), redundant
    if ep < 1 or R < 0 or (E + R) % ep:
        raise ValueError(f"{E} experts + {R} redundant slots cannot be split evenly over ep={ep} ranks")
    if (E + R) // ep > E:
        raise ValueError(f"{(E + R) // ep} slots per rank for {E} experts: a rank would hold an expert twice")
    replicas = [1] * E
    for _ in range(R):  # at most one replica per rank; ties: fewer replicas, then lower id
        e = max((e for e in range(E) if replicas[e] < ep), key=lambda e: (expert_load[e] / replicas[e], -replicas[e], -e))
        replicas[e] += 1
    per = (E + R) // ep
    load, held = [0.0] * ep, [[] for _ in range(ep)]
    per_copy = [expert_load[e] / replicas[e] for e in range(E)]  # the tokens each replica serves
    copies = sorted(((per_copy[e], e) for e in range(E) for _ in range(replicas[e])), key=lambda t: (-t[0], t[1]))
    for share, e in copies:
        free = [r for r in range(ep) if len(held[r]) < per]
        apart = [r for r in free if e not in held[r]]
        if apart:
            r = min(apart, key=lambda r: (load[r], r))
            held[r].append(e)
            load[r] += share
            continue
        # Every rank with a free slot holds e already: a full rank without e (one exists, replicas <= ep) hands
        # one of its experts the free rank lacks (one exists, the free rank holds fewer) over and takes e; the
        # swap that leaves the lighter busier rank of the two.
        _, r, r2, f = min((max(load[r] + per_copy[f], load[r2] - per_copy[f] + share), r, r2, f)
                          for r in free for r2 in range(ep) if e not in held[r2] for f in held[r2] if f not in held[r])
        held[r2].remove(f)
        held[r2].append(e)
        held[r].append(f)
        load[r] += per_copy[f]
        load[r2] += share - per_copy[f]
    return tuple(e for r in range(ep) for e in sorted(held[r]))


def engine_rank_loads(expert_load: Sequence[float], physical: Sequence[int], ep: int) -> list[float]:
    """Predicted tokens per engine rank under a physical-to-logical map, each expert's tokens split evenly
    over its replicas (as vLLM's EPLB spreads them)."""
    count = {e: physical.count(e) for e in set(physical)}
    per = len(physical) // ep
    out = [0.0] * ep
    for p, e in enumerate(physical):
        out[p // per] += expert_load[e] / count[e]
    return out


def engine_plan(prediction: Sequence[Sequence[float]], current: Sequence[Sequence[int]], ep: int,
                min_cv_drop: float = 0.08) -> tuple[tuple[int, ...], ...]:
    """The engines' placement per MoE layer (no redundant slots) from the predicted loads [layers, experts]:
    a layer takes `engine_placement` when it lowers the coefficient of variation of predicted tokens per
    engine rank by at least `min_cv_drop`, and keeps `current` (the logical expert of each slot) otherwise."""
    if len(prediction) != len(current):
        raise ValueError(f"{len(prediction)} layers of predictions for {len(current)} engine placements")
    out = []
    for load, now in zip(prediction, current):
        new = engine_placement(load, ep)
        before = coefficient_of_variation(engine_rank_loads(load, now, ep))
        after = coefficient_of_variation(engine_rank_loads(load, new, ep))
        out.append(new if new != tuple(now) and before - after >= min_cv_drop else tuple(now))
    return tuple(out)
