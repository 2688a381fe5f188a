"""The device map: the device of every rank of every role, checked once. Pure.

Devices are numbered globally, node * devices_per_node + local index. Each rank of a role gets one
device, in rank order (`placement.<role>.devices`, or the default policy below). Roles may share a
device (co-location, "RL Fusion": they time-share it by offload/onload and engine sleep/wake); two
ranks of one role may not.

    role       ranks                                             exists
    trainer    trainer.pp * dp * tp (EP is carved out of dp x tp)  always
    reference  as many as the trainer, same coordinates          when algorithm.kl_coef > 0
    rollout    rollout.num_engines * ranks per engine            always; engine k rank i is rank k * W + i,
               (W = tp, or ep when ep > 1)                       W the ranks per engine
    reward     reward.workers                                    without agent.environment or function
    environment  agent.workers                                   with agent.environment (episodes'
                                                                 environments; the reward is theirs)

Reward workers: rule verifiers (exact_match, math_verify) are CPU processes. On device_type cpu every
process stands on a device anyway, so they take a device like any rank; on cuda/npu they need no
accelerator and get none (`DeviceMap.unplaced`: plain CPU actors, no bundle) unless their devices are
listed. A reward model (kind: model) is placed like any role. Environment workers are placed as rule verifiers
are (CPU processes: a device on cpu, none on cuda/npu unless listed).

Default policy for a role whose devices are "":
    colocate: true   every role from device 0: trainer on 0..W-1, reference on the trainer's devices,
                     engine ranks on 0..R-1, reward workers on 0..workers-1.
    colocate: false  trainer (and reference, on the trainer's devices) first, engine ranks on the
                     devices after the trainer's last one, reward workers on the engines' first
                     devices (verifiers are light: they share the rollout pool, which idles while they
                     score, rather than take devices of their own).

Checks (all problems of a placement in one `ConfigError`, each naming key, value and fix): device
indices inside the cluster, one device per rank, no device twice within a role, every TP group of an
engine inside one node (engines with ep > tp may spread their data-parallel attention groups over
nodes), fabric domains that divide the nodes, and a `device_resource` that is not a name Ray reserves.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from rlhf.errors import Problem, raise_problems
from rlhf.sharding.layout import inference_layout
from rlhf.placement.devices import abbreviate, format_devices, read_devices
from rlhf.schema import DeviceType, PlacementConfig, RewardKind, RunConfig

ROLES = ("trainer", "reference", "rollout", "reward", "environment")
# Resource names Ray fills from the hardware it detects (or reserves): a bundle asking for them on a machine
# without such devices never schedules, and on one with them it would claim real accelerators.
RAY_RESERVED = ("CPU", "GPU", "NPU", "TPU", "HPU", "memory", "object_store_memory")


# --- what each role needs ---

@dataclass(frozen=True)
class RoleNeed:
    role: str
    ranks: int
    why: str  # where the count comes from, for messages: "trainer.pp * dp * tp = 1 * 2 * 1 = 2"
    placed: bool  # needs devices (False: rule verifiers on cuda/npu with no devices listed)


def _needs(cfg: RunConfig) -> tuple[list[RoleNeed], list[Problem], int]:
    """The roles of this run with their rank counts; problems with the counts; ranks per engine."""
    t, r, w, p = cfg.trainer, cfg.rollout, cfg.reward, cfg.placement
    needs: list[RoleNeed] = []
    problems: list[Problem] = []
    per_engine = 0
    if min(t.pp, t.dp, t.tp) >= 1:
        W = t.pp * t.dp * t.tp
        why = f"trainer.pp * dp * tp = {t.pp} * {t.dp} * {t.tp} = {W}"
        needs.append(RoleNeed("trainer", W, why, True))
        if cfg.algorithm.kl_coef > 0:
            needs.append(RoleNeed("reference", W, f"the reference mirrors the trainer: {why}; it runs because "
                                                  f"algorithm.kl_coef = {cfg.algorithm.kl_coef} > 0", True))
    else:
        problems.append(Problem("trainer.pp", (t.pp, t.dp, t.tp), "trainer pp, dp and tp must all be >= 1"))
    try:
        il = inference_layout(r)
    except ValueError as e:
        problems.append(Problem("rollout.ep", r.ep, str(e)))
    else:
        per_engine = il.ranks_per_engine
        what = f"tp = {r.tp}" if r.ep == 1 else f"ep = {r.ep} (data-parallel attention over ep / tp groups)"
        needs.append(RoleNeed("rollout", il.world_size, f"rollout.num_engines * ranks per engine = {r.num_engines} * "
                                                        f"{per_engine}, ranks per engine being {what}", True))
    if cfg.agent.enabled:  # the environments (or the agent function) reward the episodes: no reward workers
        if cfg.agent.environment is not None and cfg.agent.workers >= 1:
            placed = p.device_type is DeviceType.cpu or bool(str(p.environment.devices).strip())
            needs.append(RoleNeed("environment", cfg.agent.workers, f"agent.workers = {cfg.agent.workers}", placed))
    elif w.workers < 1:
        problems.append(Problem("reward.workers", w.workers, "must be >= 1 (a step's samples are split over them)"))
    else:
        placed = p.device_type is DeviceType.cpu or w.kind is RewardKind.model or bool(str(p.reward.devices).strip())
        needs.append(RoleNeed("reward", w.workers, f"reward.workers = {w.workers}", placed))
    return needs, problems, per_engine


# --- the device map ---

@dataclass(frozen=True)
class DeviceMap:
    device_type: DeviceType
    nodes: int
    devices_per_node: int
    nodes_per_fabric: int  # 0: all nodes form one fabric domain
    roles: tuple[tuple[str, tuple[int, ...]], ...]  # role -> device of each rank, in rank order
    ranks_per_engine: int = 1  # rollout ranks k * ranks_per_engine .. belong to engine k
    unplaced: tuple[tuple[str, int], ...] = ()  # (role, ranks) of roles that need no device (CPU-only actors)

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(r for r, _ in self.roles) + tuple(r for r, _ in self.unplaced)

    def devices_of(self, role: str) -> tuple[int, ...]:
        """Device of each rank of `role`; () for a role whose ranks need no device."""
        for name, devices in self.roles:
            if name == role:
                return devices
        if any(name == role for name, _ in self.unplaced):
            return ()
        raise KeyError(f"no role {role!r} in this device map; it has {', '.join(self.role_names)}")

    def shared(self, a: str, b: str) -> tuple[int, ...]:
        """The devices roles `a` and `b` both use (co-location), in order."""
        return tuple(sorted(set(self.devices_of(a)) & set(self.devices_of(b))))

    def ranks_of(self, role: str) -> int:
        for name, n in self.unplaced:
            if name == role:
                return n
        return len(self.devices_of(role))

    def node_of(self, device: int) -> int:
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} outside the cluster's devices 0-{self.num_devices - 1}")
        return device // self.devices_per_node

    def fabric_of(self, device: int) -> int:
        return self.node_of(device) // self.nodes_per_fabric if self.nodes_per_fabric else 0

    @cached_property
    def _residents(self) -> dict[int, tuple[tuple[str, int], ...]]:
        index: dict[int, list[tuple[str, int]]] = {}
        for role, devices in self.roles:
            for rank, d in enumerate(devices):
                index.setdefault(d, []).append((role, rank))
        return {d: tuple(v) for d, v in index.items()}

    def residents(self, device: int) -> list[tuple[str, int]]:
        """(role, rank) of every rank on `device`, roles in map order."""
        self.node_of(device)
        return list(self._residents.get(device, ()))

    def used_devices(self) -> tuple[int, ...]:
        return tuple(sorted(self._residents))

    def colocated(self, role_a: str, role_b: str) -> bool:
        """The two roles share at least one device."""
        return bool(set(self.devices_of(role_a)) & set(self.devices_of(role_b)))


def device_map(cfg: RunConfig) -> DeviceMap:
    """The device of every rank of every role; ConfigError listing every problem otherwise."""
    dm, problems = _build(cfg)
    if problems:
        raise_problems(problems, "placement")
    return dm


def placement_problems(cfg: RunConfig) -> list[Problem]:
    """Every problem of the run's placement (called by `rlhf.config.validate` once the layouts are valid)."""
    return _build(cfg)[1]


def cluster_problems(p: PlacementConfig) -> list[Problem]:
    """Problems of the placement file alone (no layouts needed)."""
    out: list[Problem] = []
    if p.nodes_per_fabric < 0 or (p.nodes_per_fabric > 0 and p.nodes > 0 and p.nodes % p.nodes_per_fabric):
        choices = [d for d in range(1, p.nodes + 1) if p.nodes % d == 0]
        out.append(Problem("placement.nodes_per_fabric", p.nodes_per_fabric,
                           f"must divide placement.nodes = {p.nodes} (a fabric domain is a whole number of nodes); "
                           f"use one of {choices}, or 0 for one domain"))
    for name in ("fabric_gbytes_per_s", "cross_fabric_gbytes_per_s", "cpus_per_device"):
        if getattr(p, name) <= 0:
            out.append(Problem(f"placement.{name}", getattr(p, name), "must be > 0"))
    if p.device_memory_gib < 0:
        out.append(Problem("placement.device_memory_gib", p.device_memory_gib, "must be >= 0 (0: unknown)"))
    res = p.device_resource
    if not res or res.upper() in {n.upper() for n in RAY_RESERVED} or res.startswith(("node:", "accelerator_type:")):
        out.append(Problem("placement.device_resource", res,
                           "Ray reserves this name (it fills CPU, GPU, NPU, ... from the hardware it detects, so a "
                           "bundle asking for it would wait for, or take, real devices); use a custom name such as "
                           "rlhf_device"))
    for role in ROLES:
        problem = read_devices(getattr(p, role).devices, f"placement.{role}.devices")[1]
        if problem is not None:
            out.append(problem)
    return out


def _default(role: str, ranks: int, chosen: dict[str, tuple[int, ...]], colocate: bool) -> tuple[int, ...]:
    if role == "reference" and "trainer" in chosen:
        return chosen["trainer"]
    start = 0
    if not colocate and role == "rollout" and chosen.get("trainer"):
        start = max(chosen["trainer"]) + 1
    if not colocate and role in ("reward", "environment") and chosen.get("rollout"):
        if len(chosen["rollout"]) >= ranks:
            return chosen["rollout"][:ranks]
        start = chosen["rollout"][0]
    return tuple(range(start, start + ranks))


def _build(cfg: RunConfig) -> tuple[DeviceMap | None, list[Problem]]:
    p = cfg.placement
    problems = cluster_problems(p)
    for name in ("nodes", "devices_per_node"):
        if getattr(p, name) < 1:
            problems.append(Problem(f"placement.{name}", getattr(p, name), "must be >= 1"))
    if p.nodes < 1 or p.devices_per_node < 1:
        return None, problems
    needs, count_problems, per_engine = _needs(cfg)
    problems += count_problems
    chosen: dict[str, tuple[int, ...]] = {}
    unplaced: list[tuple[str, int]] = []
    for need in needs:
        if not need.placed:
            unplaced.append((need.role, need.ranks))
            continue
        text = str(getattr(p, need.role).devices).strip()
        devices, bad_syntax = read_devices(text, "")
        if bad_syntax is not None:  # reported by cluster_problems
            continue
        default = not devices
        if default:
            devices = _default(need.role, need.ranks, chosen, p.colocate)
        chosen[need.role] = devices
        problems += _role_problems(cfg, need, devices, text, default, per_engine)
    shared = sorted(set(chosen.get("trainer", ())) & set(chosen.get("rollout", ())))
    if cfg.stale_sync.max_staleness > 0 and shared and cfg.rollout.sleep_level and cfg.stale_sync.partial_rollout:
        problems.append(Problem(
            "stale_sync.partial_rollout", True,
            f"the engines and the trainer share device(s) {abbreviate(shared)} and the engines sleep "
            f"(rollout.sleep_level={cfg.rollout.sleep_level}), so they take turns: a sync never arrives during a "
            "generation; drop partial_rollout, keep the engines awake (rollout.sleep_level=0), or give "
            "placement.rollout.devices and placement.trainer.devices no device in common"))
    if problems:
        return None, problems
    roles = tuple((n.role, chosen[n.role]) for n in needs if n.role in chosen)
    return DeviceMap(p.device_type, p.nodes, p.devices_per_node, p.nodes_per_fabric, roles, per_engine,
                     tuple(unplaced)), []


def _role_problems(cfg: RunConfig, need: RoleNeed, devices: tuple[int, ...], text: str, default: bool,
                   per_engine: int) -> list[Problem]:
    p = cfg.placement
    key = f"placement.{need.role}.devices"
    n_dev = p.nodes * p.devices_per_node
    said = (f"the default policy (colocate: {str(p.colocate).lower()}) gives devices {abbreviate(devices)}; "
            if default else "")
    out: list[Problem] = []
    if len(devices) != need.ranks:
        out.append(Problem(key, text, f"lists {len(devices)} devices; the {need.role} needs {need.ranks}, one per "
                                      f"rank ({need.why})"))
    twice = sorted(d for d, n in Counter(devices).items() if n > 1)
    if twice:
        out.append(Problem(key, text, f"device(s) {twice[:8]} listed twice; each rank of a role needs a device of its "
                                      f"own (different roles may share a device, ranks of one role may not)"))
    outside = sorted({d for d in devices if not 0 <= d < n_dev})
    if outside:
        fix = ("list devices explicitly, shrink the layouts, or enlarge the cluster" if default else
               f"list devices below {n_dev}, or enlarge the cluster")
        out.append(Problem(key, text, f"{said}device(s) {abbreviate(outside)} are outside the cluster, whose devices are "
                                      f"0-{n_dev - 1} (placement.nodes * devices_per_node = {p.nodes} * "
                                      f"{p.devices_per_node}); {fix}"))
    if need.role == "rollout" and not out and per_engine:
        out += _engine_node_problems(cfg, devices, key, text, said, per_engine)
    return out


def _engine_node_problems(cfg: RunConfig, devices: tuple[int, ...], key: str, text: str, said: str,
                          per_engine: int) -> list[Problem]:
    """Every TP group of every engine sits inside one node."""
    tp, dpn = cfg.rollout.tp, cfg.placement.devices_per_node
    split: list[str] = []
    for k in range(cfg.rollout.num_engines):
        for g in range(per_engine // tp):
            first = k * per_engine + g * tp
            group = devices[first:first + tp]
            nodes = sorted({d // dpn for d in group})
            if len(nodes) > 1:
                split.append(f"engine {k}'s TP group of ranks {first}-{first + tp - 1} is on devices "
                             f"{format_devices(group)}, nodes {nodes}")
    if not split:
        return []
    more = f" (and {len(split) - 1} more such groups)" if len(split) > 1 else ""
    return [Problem(key, text, f"{said}{split[0]}{more}; tensor parallelism stays inside one node: give each group "
                               f"of rollout.tp = {tp} consecutive engine ranks devices of one node (node n holds "
                               f"devices {dpn}n to {dpn}n+{dpn - 1})")]
