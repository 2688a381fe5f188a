"""The weight-sync group of a run: which device each transfer rank sits on, the topology the planner
reads (node of each rank, link bandwidth), and `SyncLayout`, the two shard specs and the plan. Pure.

Transfer ranks: trainer rank r is r; rank i of engine k is W + k * ranks_per_engine + i (W the
trainer's world size). Every worker of every engine (each TP rank, each EP rank, each attention-DP
rank) is a rank of the group and receives exactly the slices its own vLLM buffers hold
(`rlhf.model.engine_sharding`), from the trainer ranks that own them. `rlhf plan` and `rlhf train`
build the sync with the same function (`sync_layout`), so the bytes one prints are the bytes the
other moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from rlhf.layout import InferenceLayout, Layout, inference_layout, trainer_layout
from rlhf.model.engine_sharding import engine_shard_spec, physical_experts
from rlhf.model.sharding import trainer_shard_spec
from rlhf.placement.device_map import DeviceMap
from rlhf.schema import ModelConfig, RunConfig
from weight_sync.plan import Plan, Topology, plan_reshard
from weight_sync.spec import ShardSpec


def transfer_devices(dm: DeviceMap) -> tuple[int, ...]:
    """Device of each rank of the weight-sync group: trainer ranks 0..W-1, then engine ranks (engine k
    rank i is W + k * ranks_per_engine + i)."""
    return dm.devices_of("trainer") + dm.devices_of("rollout")


def transfer_topology(cfg: RunConfig, dm: DeviceMap, link_bytes_per_s: float | None = None) -> Topology:
    """The planner's view of the weight-sync group: node of each transfer rank and the link bandwidth,
    `placement.fabric_gbytes_per_s` unless a measured one is given. Across fabric domains links are
    slower (cross_fabric_gbytes_per_s); the planner takes one bandwidth, so the floor it reports stays a
    lower bound."""
    p = cfg.placement
    bandwidth = link_bytes_per_s if link_bytes_per_s is not None else p.fabric_gbytes_per_s * 1e9
    return Topology(f"{dm.nodes}x{dm.devices_per_node} {dm.device_type.value}",
                    tuple(dm.node_of(d) for d in transfer_devices(dm)), bandwidth)


@dataclass(frozen=True)
class SyncLayout:
    """The run's weight sync: trainer layout -> every rank of every engine, on `topology`."""

    model: ModelConfig
    trainer: Layout
    engines: InferenceLayout
    topology: Topology  # nodes of the transfer ranks (trainer ranks, then every engine rank)
    zero_stage: int = 1  # the trainer's: 3 row-shards parameters, so every DP rank sends its own rows
    devices: tuple[int, ...] = ()  # device of each transfer rank, when known (same-device pairs)
    # the trainer's expert -> EP shard map per MoE layer once expert-load balancing moved experts (None: the
    # contiguous default); the plan is rebuilt when it changes
    expert_maps: tuple[tuple[int, ...], ...] | None = None
    # the engines' placement per MoE layer once it follows the trainer's load predictions: the logical expert
    # of each physical slot, rank by rank (None: the contiguous default); every worker takes its layers' maps
    # from here when it installs a sync (engines follow, docs/expert_balance.md)
    engine_experts: tuple[tuple[int, ...], ...] | None = None
    # the engines' dtype (rollout.dtype), what travels: bf16 engines of an fp32 trainer receive half the bytes,
    # the trainer casting as it packs (None: the model's dtype)
    engine_dtype: str | None = None

    def __post_init__(self):
        if self.topology.world_size != self.world_size:
            raise ValueError(f"sync topology {self.topology.name} has {self.topology.world_size} ranks; the trainer "
                             f"({self.trainer.world_size}) and the engines ({self.engines}: "
                             f"{self.engines.world_size} ranks) need {self.world_size}")
        if self.engine_experts is not None:
            moe = self.model.num_hidden_layers - self.model.first_k_dense_layers
            if self.engines.ep == 1 or self.engines.redundant_experts:
                raise ValueError(f"engine expert placement given for engines {self.engines}: the engines follow the "
                                 f"trainer's placement only with ep > 1 and no redundant experts (those are vLLM "
                                 f"EPLB's to place)")
            if len(self.engine_experts) != moe:
                raise ValueError(f"engine expert placement for {len(self.engine_experts)} MoE layers; the model "
                                 f"has {moe}")
        if self.devices and len(self.devices) != self.world_size:
            raise ValueError(f"sync layout: {len(self.devices)} devices given for {self.world_size} transfer ranks "
                             f"(the trainer's {self.trainer.world_size}, then {self.engines.world_size} engine ranks)")

    @property
    def world_size(self) -> int:
        return self.trainer.world_size + self.engines.world_size

    def engine_physical(self) -> dict[int, tuple[int, ...]]:
        """Layer -> the logical expert of every physical slot of each engine ({} when ep = 1)."""
        m = self.model
        given = None if self.engine_experts is None else {
            m.first_k_dense_layers + i: tuple(p) for i, p in enumerate(self.engine_experts)}
        return physical_experts(m, self.engines, given)

    def engine_ranks(self, k: int) -> range:
        """The transfer ranks of engine k's workers, in the engine's own rank order."""
        first = self.trainer.world_size + k * self.engines.ranks_per_engine
        return range(first, first + self.engines.ranks_per_engine)

    def src_spec(self) -> ShardSpec:
        return _specs(self)[0]

    def dst_spec(self) -> ShardSpec:
        return _specs(self)[1]

    def plan(self) -> Plan:
        """Cached by `plan_reshard` while the specs and the topology's nodes do not change (the same spec
        objects for an equal layout: every step's sync finds its plan at once)."""
        src, dst = _specs(self)
        return plan_reshard(src, dst, self.topology)

    def same_device_pairs(self, devices: Sequence[int] | None = None) -> frozenset[tuple[int, int]]:
        """(trainer rank, engine rank) pairs on one device, for `run_plan(..., same_device=...)`. `devices[r]`
        is transfer rank r's device (default: `self.devices`)."""
        devices = tuple(self.devices if devices is None else devices)
        if len(devices) != self.world_size:
            raise ValueError(f"same_device_pairs: {len(devices)} devices given for {self.world_size} transfer ranks "
                             f"(the trainer's {self.trainer.world_size}, then {self.engines.world_size} engine ranks)")
        w = self.trainer.world_size
        return frozenset((r, e) for e in range(w, self.world_size) for r in range(w) if devices[r] == devices[e])


@lru_cache(maxsize=4)
def _specs(sync: SyncLayout) -> tuple[ShardSpec, ShardSpec]:
    """The trainer's and the engines' shard specs of a sync layout, built once per (equal) layout. The engines
    hold no MTP modules (vLLM loads them only as a speculative-decoding draft, which rollouts do not run), so
    none are sent; the trainer carries them unchanged into checkpoints and exports."""
    return (trainer_shard_spec(sync.model, sync.trainer, zero_stage=sync.zero_stage, expert_maps=sync.expert_maps),
            engine_shard_spec(sync.model, sync.engines, rank_offset=sync.trainer.world_size, include_mtp=False,
                              physical_experts=sync.engine_physical() or None, dtype=sync.engine_dtype))


def sync_layout(cfg: RunConfig, dm: DeviceMap, link_bytes_per_s: float | None = None) -> SyncLayout:
    """The run's weight sync: the trainer's ranks and every engine rank, on the nodes of their devices.
    `rlhf plan` and `rlhf train` both build it here."""
    return SyncLayout(cfg.model, trainer_layout(cfg.trainer), inference_layout(cfg.rollout),
                      transfer_topology(cfg, dm, link_bytes_per_s), cfg.trainer.zero_stage, transfer_devices(dm),
                      engine_dtype=cfg.rollout.dtype.value)
