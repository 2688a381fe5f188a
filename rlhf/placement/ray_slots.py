"""How devices become Ray resources: one STRICT_PACK placement group per node with one bundle per device
(`placement_bundles`); an actor goes to its device's bundle, and when k role ranks share a device each
takes 1/k of the device resource and of the bundle's CPUs (`actor_options`), so co-located actors fit in
one bundle. On cpu, the core each engine rank binds its OpenMP threads to (`engine_cpu_cores`). Pure:
the actors module spawns with these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlhf.placement.device_map import DeviceMap
from rlhf.schema import DeviceType, PlacementConfig

ACCELERATOR = {DeviceType.cuda: "GPU", DeviceType.npu: "NPU"}


def placement_bundles(p: PlacementConfig) -> list[list[dict[str, float]]]:
    """Per node, one bundle per device: for one STRICT_PACK placement group per node (bundle i of node n
    is device n * devices_per_node + i)."""
    accelerator = ACCELERATOR.get(p.device_type, p.device_resource)
    bundle = {"CPU": p.cpus_per_device, accelerator: 1}
    return [[dict(bundle) for _ in range(p.devices_per_node)] for _ in range(p.nodes)]


@dataclass(frozen=True)
class ActorSlot:
    """Where one role rank runs, in Ray's terms. `node` indexes the per-node placement groups and `bundle`
    the bundle inside it; both None for a CPU-only actor scheduled outside the groups."""

    node: int | None
    bundle: int | None
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]

    def spawn_kwargs(self, placement_groups: Sequence) -> dict:
        """Keyword arguments for `actors.remote.spawn`, given the placement group of each node (in node
        order, as `placement_bundles` lists them)."""
        group = placement_groups[self.node] if self.node is not None else None
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.resources),
                "placement_group": group, "bundle_index": self.bundle}


def _share(amount: float, k: int) -> float:
    """amount / k, rounded down to Ray's resource precision (1e-4) so that k shares fit in the bundle."""
    return int(amount * 10_000 / k) / 10_000


def actor_options(dm: DeviceMap, p: PlacementConfig, role: str, rank: int) -> ActorSlot:
    """The slot of rank `rank` of `role`: its device's bundle, with 1/k of the device and of its CPUs when k
    role ranks share the device."""
    devices = dm.devices_of(role)
    if not devices:
        if not 0 <= rank < dm.ranks_of(role):
            raise ValueError(f"{role} has {dm.ranks_of(role)} ranks; rank {rank} does not exist")
        return ActorSlot(None, None, 1.0, 0.0, {})
    if not 0 <= rank < len(devices):
        raise ValueError(f"{role} has {len(devices)} ranks; rank {rank} does not exist")
    d = devices[rank]
    k = len(dm.residents(d))
    share = _share(1.0, k)
    num_gpus = share if dm.device_type is DeviceType.cuda else 0.0
    resources = {} if dm.device_type is DeviceType.cuda else {ACCELERATOR.get(dm.device_type, p.device_resource): share}
    return ActorSlot(dm.node_of(d), d % dm.devices_per_node, _share(p.cpus_per_device, k), num_gpus, resources)


def engine_cpu_cores(dm: DeviceMap, engine: int, cpus_per_node: int) -> list[int] | None:
    """cpu devices: the core each rank of rollout engine `engine` binds its OpenMP threads to, the core
    numbered like its stand-in device on its node (vLLM's "auto" binding would put every engine of a
    machine on core 0). None, leaving vLLM's own binding (measured fastest for one engine), for one
    engine or other device types."""
    rollout = dm.devices_of("rollout")
    if dm.device_type is not DeviceType.cpu or len(rollout) <= dm.ranks_per_engine:
        return None
    mine = rollout[engine * dm.ranks_per_engine:(engine + 1) * dm.ranks_per_engine]
    return [d % dm.devices_per_node % cpus_per_node for d in mine]
