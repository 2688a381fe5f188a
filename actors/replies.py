"""What the roles answer the driver: one small dataclass per call, so a renamed field fails where it is
read (a unit test of the driver's metrics), not in an end-to-end run. Plain values and CPU tensors
only; every reply carries when its work started and how long it took (`start`, `seconds`: the trace).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: a reward worker, which needs ScoreReply, never loads torch for it
    import torch


@dataclass(frozen=True)
class LogprobsReply:
    """Per-token logprobs and entropies [rows, T-1] of one DP index's samples (`rows`: their batch rows)."""

    rows: torch.Tensor
    logp: torch.Tensor
    entropy: torch.Tensor
    start: float
    seconds: float
    # with engine routes in the batch: per token [rows, T], how many MoE layers chose another top-k set than
    # the engine (the first forward of the step, rlhf.moe.routing.RouteStats)
    route_differs: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class UpdateStats:
    """One trainer rank's policy update: token-weighted sums over its micro-batches, and the step's
    loss, gradient norm and learning rate (the same on every rank)."""

    loss: float
    grad_norm: float
    optimizer_steps: int
    lr: float
    clip_fraction: float
    ratio_mean: float
    kl: float
    entropy: float
    tokens: float
    router_bias_abs_max: float = 0.0  # largest |correction bias| of this rank's sigmoid routers after the update


@dataclass(frozen=True)
class UpdateReply:
    stats: UpdateStats
    router: Optional[list]  # tokens per expert per MoE layer of the stage ([layers][experts]); one rank per stage
    start: float
    seconds: float
    # on-policy updates: the trainer's logprobs of the batch before the step (from the update's own forward),
    # from the ranks that return rows (last stage, TP index 0)
    logprobs: Optional[LogprobsReply] = None


@dataclass(frozen=True)
class SendReply:
    """A trainer rank's side of a weight sync."""

    bytes_sent: int
    bytes_shm_sent: int
    bytes_local: int
    start: float
    seconds: float


@dataclass(frozen=True)
class ReceiveReply:
    """An engine's side of a weight sync: what arrived, how (network, shared memory, in place), the
    transfers checksummed, and the time to receive and to install."""

    version: int
    bytes_received: int
    bytes_shm: int
    bytes_in_place: int
    checked_transfers: int
    transfer_seconds: float  # every worker's part received and checked
    install_seconds: float  # every worker's part installed
    start: float
    seconds: float
    ranks: tuple[int, ...] = ()  # transfer rank of each worker
    bytes_per_rank: tuple[int, ...] = ()  # bytes each worker received (network + shared memory)
    install_path: str = ""  # "direct", "reload" (vLLM's) or "in place" (`actors.vllm.worker_ext.rlhf_install`)


@dataclass(frozen=True)
class SyncReplies:
    """Every rank's reply to one weight sync."""

    sends: list[SendReply]  # trainer ranks, in rank order
    receives: list[ReceiveReply]  # engines, in engine order

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in [*self.sends, *self.receives])


@dataclass(frozen=True)
class ScoreReply:
    scores: list[float]
    start: float
    seconds: float
    verdicts: dict = field(default_factory=dict)  # the code verifier: samples per status (passed, failed, ...)
