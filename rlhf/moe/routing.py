"""Routing replay (R2/R3): one forward's expert selections, forced, recorded or compared.

In MoE RL the engine and the trainer pick each token's top-k experts independently; where two router
scores are near a tie, a precision or kernel difference picks other experts and the token's logprob
jumps for reasons unrelated to the update. Replay forces the selection the engine made (R3, `rollout`)
or the trainer's own old-logprob forward made (R2, `old`), while the routing weights are still the live
router's probabilities at those ids, so the router keeps its gradient.

A `Routing` travels with one micro-batch's forward (in the layers' context, so recomputation and
pipeline stages see the same object): routes are [B, T, L, k] integers over the MoE layers in order
(L = MoE layers, not all layers), -1 on tokens with no route (padding, a sequence's last token, which
the engine never fed back). Each MoE block reads its layer's slice and writes what its router chose.

Legend: B batch, T tokens, S = B*T rows, L MoE layers, k top-k, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

ROUTE_DTYPE = torch.int16  # expert ids < 32768: 2 bytes per (token, layer, slot)


@dataclass
class Routing:
    """One forward's routing: what to force (`forced_BTLk`), what to compare the live choice with
    (`engine_BTLk`), and, filled by the MoE blocks, what each layer's router chose (`chosen`, when
    `record`) and where its live top-k set differs from the engine's (`differs`)."""

    forced_BTLk: Optional[torch.Tensor] = None
    engine_BTLk: Optional[torch.Tensor] = None
    record: bool = False
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> live top-k [S, k]
    differs: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [S] bool

    def layer(self, routes_BTLk: Optional[torch.Tensor], moe_index: int) -> Optional[torch.Tensor]:
        return None if routes_BTLk is None else routes_BTLk[:, :, moe_index].reshape(-1, routes_BTLk.shape[-1])

    def differ_count_BT(self, B: int, T: int) -> torch.Tensor:
        """Per token, how many of this forward's MoE layers chose another top-k set than the engine."""
        out = torch.zeros(B * T, dtype=ROUTE_DTYPE, device=_device_of(self.differs))
        for d in self.differs.values():
            out += d.to(ROUTE_DTYPE)
        return out.view(B, T)

    def chosen_BTLk(self, B: int, T: int, num_layers: int, k: int) -> torch.Tensor:
        """The recorded choices as routes; layers this forward did not run (another stage's) stay -1."""
        out = torch.full((B * T, num_layers, k), -1, dtype=ROUTE_DTYPE, device=_device_of(self.chosen))
        for l, c in self.chosen.items():
            out[:, l] = c
        return out.view(B, T, num_layers, k)


def _device_of(per_layer: dict[int, torch.Tensor]) -> torch.device:
    return next(iter(per_layer.values())).device if per_layer else torch.device("cpu")


def route(probs_SE: torch.Tensor, k: int, forced_Sk: Optional[torch.Tensor], choice_SE: Optional[torch.Tensor] = None):
    """(weights [S, k] before any renormalisation, experts [S, k], live top-k experts [S, k]). The live
    top-k ranks `choice_SE` where given (a sigmoid router's biased, group-masked scores), else the
    probabilities; weights are always the probabilities of the experts taken. Rows of `forced_Sk` that hold
    ids (not -1) take those experts, the others the live top-k. Forcing a row's own live choice gives its
    live weights bit for bit."""
    if choice_SE is None:
        live_w, live_e = torch.topk(probs_SE, k, dim=-1)
    else:
        live_e = torch.topk(choice_SE, k, dim=-1).indices
        live_w = probs_SE.gather(1, live_e)
    if forced_Sk is None:
        return live_w, live_e, live_e
    use_S1 = forced_Sk[:, :1] >= 0
    experts = torch.where(use_S1, forced_Sk.long(), live_e)
    return probs_SE.gather(1, experts), experts, live_e


def sets_differ(a_Sk: torch.Tensor, b_Sk: torch.Tensor) -> torch.Tensor:
    """[S] bool: whether two top-k selections pick different expert sets (order within k ignored)."""
    return (a_Sk.long().sort(-1).values != b_Sk.long().sort(-1).values).any(-1)


def observe(routing: Routing, moe_index: int, live_Sk: torch.Tensor, engine_Sk: Optional[torch.Tensor],
            gather=lambda t: t) -> None:
    """Record a layer's live choice and where it differs from the engine's (rows with an engine route).
    `gather` brings a rank's share of the rows to all of them (tensor-parallel MoE blocks)."""
    with torch.no_grad():
        if routing.record:
            routing.chosen[moe_index] = gather(live_Sk.to(ROUTE_DTYPE))
        if engine_Sk is not None:
            routing.differs[moe_index] = gather(sets_differ(live_Sk, engine_Sk) & (engine_Sk[:, 0] >= 0))


@dataclass(frozen=True)
class RouteStats:
    """How often the trainer's live routing differs from the engine's, over the tokens the engine routed."""

    mismatch: float  # share of (token, MoE layer) top-k sets that differ
    tokens_any_mismatch: float  # share of tokens with at least one layer that differs
    token_layers: int  # (token, layer) pairs compared

    @staticmethod
    def of(differs_BT: torch.Tensor, engine_BTLk: torch.Tensor) -> "RouteStats":
        return RouteStats.counted(differs_BT, (engine_BTLk[:, :, 0, 0] >= 0).sum(1), engine_BTLk.shape[2])

    @staticmethod
    def counted(differs_BT: torch.Tensor, routed_B: torch.Tensor | Sequence[int], num_layers: int) -> "RouteStats":
        """`routed_B`: per sample, how many of its first tokens the engine routed (the others count nothing)."""
        routed_B = torch.as_tensor(routed_B)
        T = differs_BT.shape[1]
        routed_BT = torch.arange(T)[None, :] < routed_B[:, None]
        tokens = int(routed_B.clamp(max=T).sum())
        d = differs_BT.long() * routed_BT
        pairs = tokens * num_layers
        return RouteStats(float(d.sum()) / max(pairs, 1), float((d > 0).sum()) / max(tokens, 1), pairs)


@dataclass(frozen=True)
class RouteShare:
    """The routes one trainer rank needs, and no more: the samples its DP index trains on (`rows`) and the
    MoE layers of its pipeline stage. TP and EP ranks of one (DP index, stage) share one."""

    rows: torch.Tensor  # [R] batch rows, ascending
    layers: tuple[int, ...]  # MoE layer indices
    routes_RTLk: torch.Tensor  # [R, T, len(layers), k]
    num_layers: int  # MoE layers of the model

    @property
    def nbytes(self) -> int:
        return self.routes_RTLk.numel() * self.routes_RTLk.element_size()

    def rows_BTLk(self, rows: torch.Tensor, T: int) -> torch.Tensor:
        """The routes of batch rows `rows` over their first T tokens as a forward takes them [B, T, L, k]: -1
        for samples outside the share and for other stages' layers. One micro-batch at a time, so a rank
        never holds its share dense over every layer."""
        R, _, _, k = self.routes_RTLk.shape
        out = torch.full((len(rows), T, self.num_layers, k), -1, dtype=ROUTE_DTYPE)
        if not R or not self.layers:
            return out
        at = torch.searchsorted(self.rows, rows).clamp(max=R - 1)
        have = self.rows[at] == rows
        part = self.routes_RTLk[at[have], :T]
        out[have.nonzero().flatten()[:, None], :part.shape[1], torch.tensor(self.layers)] = part.transpose(1, 2)
        return out

    def expand(self, B: int) -> torch.Tensor:
        """As the whole batch's routes [B, T, L, k]."""
        return self.rows_BTLk(torch.arange(B), self.routes_RTLk.shape[1])


@dataclass(frozen=True)
class RouteRef:
    """One sample's routes kept apart from it (rollout.capture_routes in `rlhf train`): rows
    [start, start + positions) of each trainer stage's block, a [rows, the stage's MoE layers, k] array the
    engine returned for its whole generate call. `blocks` holds the blocks' object references (Ray's); the
    driver only passes them on, and each trainer rank reads the rows it trains on
    (`RouteFetch.resolve`)."""

    start: int
    positions: int  # the tokens the engine fed through the model: prompt + response - 1
    blocks: tuple = ()  # per trainer stage
    itemsize: int = 1  # of the blocks' integers (uint8 up to 256 experts, int16 above)

    def nbytes(self, layers: int, k: int) -> int:
        return self.positions * layers * k * self.itemsize


@dataclass(frozen=True)
class RouteFetch:
    """What one trainer rank (a DP index and a pipeline stage) reads of the engines' routes: for each of its
    batch rows (ascending) the sample's place in a block of its stage. TP and EP ranks of one (DP index,
    stage) share one."""

    rows: tuple[int, ...]
    refs: tuple[RouteRef | None, ...]  # per row (None: a sample without routes, an episode with no turn: -1)
    stage: int
    layers: tuple[int, ...]  # the stage's MoE layer indices
    num_layers: int  # MoE layers of the model
    k: int
    T: int  # the batch's padded length

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes(len(self.layers), self.k) for r in self.refs if r is not None)

    def resolve(self, get: Callable[[list[Any]], list[Any]]) -> RouteShare:
        """The rank's `RouteShare`: `get` turns block references into arrays (`ray.get`; each block is read
        once however many rows it holds)."""
        blocks = list(dict.fromkeys(r.blocks[self.stage] for r in self.refs if r is not None))
        arrays = dict(zip(blocks, get(blocks))) if blocks else {}
        out = torch.full((len(self.rows), self.T, len(self.layers), self.k), -1, dtype=ROUTE_DTYPE)
        view = out.numpy()  # the arrays come read-only (shared memory): copied once, into place
        for i, r in enumerate(self.refs):
            if r is not None:
                view[i, :r.positions] = arrays[r.blocks[self.stage]][r.start:r.start + r.positions]
        return RouteShare(torch.tensor(self.rows, dtype=torch.long), self.layers, out, self.num_layers)
