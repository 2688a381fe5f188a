"""The weight-sync group of a run: which device each transfer rank sits on, the topology the planner
reads (node of each rank, link bandwidth), and `SyncLayout`, the two shard specs and the plan. Pure.

Transfer ranks in the run: trainer rank r is r; engine k's host process is trainer_world + k. The host
receives its engine's weights in vLLM's fused buffer layout (qkv, gate_up, stacked experts, padded
vocabulary) and installs them in every worker of the engine (`actors.vllm_engine.VLLMEngine.receive_weights`);
vLLM's loader gives each TP / EP worker its own slice. So an engine host receives one full copy of the
weights whatever the engine's TP: with TP > 1 on one host that is what its workers need in total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlhf.layout import InferenceLayout, Layout, trainer_layout
from rlhf.model.engine_sharding import engine_shard_spec
from rlhf.model.sharding import trainer_shard_spec
from rlhf.placement.device_map import DeviceMap
from rlhf.schema import ModelConfig, RunConfig
from weight_sync.plan import Plan, Topology, plan_reshard
from weight_sync.spec import ShardSpec


def transfer_devices(dm: DeviceMap) -> tuple[int, ...]:
    """Device of each rank of the weight-sync group: trainer ranks 0..W-1, then engine ranks (engine k
    rank i is W + k * ranks_per_engine + i)."""
    return dm.devices_of("trainer") + dm.devices_of("rollout")


def transfer_topology(cfg: RunConfig, dm: DeviceMap) -> Topology:
    """The planner's view of the weight-sync group: node of each transfer rank and the fabric link
    bandwidth. Across fabric domains links are slower (cross_fabric_gbytes_per_s); the planner takes one
    bandwidth, so the floor it reports stays a lower bound."""
    p = cfg.placement
    return Topology(f"{dm.nodes}x{dm.devices_per_node} {dm.device_type.value}",
                    tuple(dm.node_of(d) for d in transfer_devices(dm)), p.fabric_gbytes_per_s * 1e9)


@dataclass(frozen=True)
class SyncLayout:
    model: ModelConfig
    trainer: Layout
    engines: int
    topology: Topology  # nodes of the transfer ranks (trainer ranks, then engine hosts)
    zero_stage: int = 1  # the trainer's: 3 row-shards parameters, so every DP rank sends its own rows

    def __post_init__(self):
        if self.topology.world_size != self.world_size:
            raise ValueError(f"sync topology {self.topology.name} has {self.topology.world_size} ranks; the trainer "
                             f"({self.trainer.world_size}) and {self.engines} engine host(s) need {self.world_size}")

    @property
    def world_size(self) -> int:
        return self.trainer.world_size + self.engines

    def engine_rank(self, k: int) -> int:
        return self.trainer.world_size + k

    def src_spec(self) -> ShardSpec:
        return trainer_shard_spec(self.model, self.trainer, zero_stage=self.zero_stage)

    def dst_spec(self) -> ShardSpec:
        return engine_shard_spec(self.model, InferenceLayout(tp=1, engines=self.engines),
                                 rank_offset=self.trainer.world_size)

    def plan(self) -> Plan:
        return plan_reshard(self.src_spec(), self.dst_spec(), self.topology)

    def same_device_pairs(self, devices: Sequence[int]) -> frozenset[tuple[int, int]]:
        """(trainer rank, engine host rank) pairs on one device, for `run_plan(..., same_device=...)`.
        `devices[r]` is transfer rank r's device: the trainer ranks' devices, then each engine host's
        (its engine's first device), as the driver lists them for the sync topology."""
        if len(devices) != self.world_size:
            raise ValueError(f"same_device_pairs: {len(devices)} devices given for {self.world_size} transfer ranks "
                             f"(the trainer's {self.trainer.world_size}, then {self.engines} engine host(s))")
        w = self.trainer.world_size
        return frozenset((r, self.engine_rank(k)) for k in range(self.engines) for r in range(w)
                         if devices[r] == devices[w + k])


def sync_devices(dm: DeviceMap) -> tuple[int, ...]:
    """Device of each rank of the run's weight-sync group: the trainer ranks', then each engine host's (its
    engine's first device)."""
    rollout, per = dm.devices_of("rollout"), dm.ranks_per_engine
    return dm.devices_of("trainer") + tuple(rollout[k] for k in range(0, len(rollout), per))


def sync_layout(cfg: RunConfig, dm: DeviceMap) -> SyncLayout:
    """The run's weight sync: trainer ranks and engine hosts, on the nodes of their devices."""
    p = cfg.placement
    topology = Topology(f"{p.nodes}x{p.devices_per_node} {p.device_type.value}",
                        tuple(dm.node_of(d) for d in sync_devices(dm)), p.fabric_gbytes_per_s * 1e9)
    return SyncLayout(cfg.model, trainer_layout(cfg.trainer), cfg.rollout.num_engines, topology,
                      cfg.trainer.zero_stage)
