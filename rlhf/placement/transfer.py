"""The weight-sync group of a run on its devices: which device each transfer rank sits on, the topology the
planner reads (node of each rank, link bandwidth), and `sync_layout`, the run's `SyncLayout`
(`rlhf.sharding.sync`: the two shard specs and the plan). Pure. `rlhf plan` and `rlhf train` build the
sync with the same function, so the bytes one prints are the bytes the other moves.
"""

from __future__ import annotations

from rlhf.placement.device_map import DeviceMap
from rlhf.schema import RunConfig
from rlhf.sharding.layout import inference_layout, trainer_layout
from rlhf.sharding.sync import SyncLayout
from weight_sync.plan import Topology


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


def sync_layout(cfg: RunConfig, dm: DeviceMap, link_bytes_per_s: float | None = None) -> SyncLayout:
    """The run's weight sync: the trainer's ranks and every engine rank, on the nodes of their devices.
    `rlhf plan` and `rlhf train` both build it here."""
    return SyncLayout(cfg.model, trainer_layout(cfg.trainer), inference_layout(cfg.rollout),
                      transfer_topology(cfg, dm, link_bytes_per_s), cfg.trainer.zero_stage, transfer_devices(dm),
                      engine_dtype=cfg.rollout.dtype.value, quantization=cfg.rollout.quantization.value)
