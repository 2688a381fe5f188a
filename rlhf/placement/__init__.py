"""Placement: the device of every rank of every role, checked once; how devices become Ray bundles;
and what a placement implies (transfer topology, memory per device; `rlhf plan` prints them:
`rlhf.report.plan`). Pure: imports neither ray nor torch. One file per job:

    devices     device lists ("0-3,6"): parse, format, abbreviate
    device_map  roles -> devices, every check of a placement
    ray_slots   Ray placement groups, bundles and actor options; cpu core binding
    transfer    the weight-sync group's devices and topology
    device_memory  memory per device: the memory model (`rlhf.sim.memory`) on this placement's devices
"""

from rlhf.placement.device_map import (ROLES, DeviceMap, RoleNeed, cluster_problems, device_map,
                                       placement_problems)
from rlhf.placement.devices import format_devices, parse_devices
from rlhf.placement.device_memory import memory_estimate, memory_notes
from rlhf.placement.ray_slots import ActorSlot, actor_options, engine_cpu_cores, placement_bundles
from rlhf.placement.transfer import sync_layout, transfer_devices, transfer_topology

__all__ = ["ROLES", "ActorSlot", "DeviceMap", "RoleNeed", "actor_options", "cluster_problems", "device_map",
           "engine_cpu_cores", "format_devices", "memory_estimate", "memory_notes", "parse_devices",
           "placement_bundles", "placement_problems", "sync_layout", "transfer_devices",
           "transfer_topology"]
