"""Placement: the device of every rank of every role, checked once; how devices become Ray bundles;
and what a placement implies (transfer topology, memory estimate, `rlhf plan` report). Pure: imports
neither ray nor torch.

Devices are numbered globally, node * devices_per_node + local index. Each rank of a role gets one
device, in rank order (`placement.<role>.devices`, or the default policy below). Roles may share a
device (co-location, "RL Fusion": they time-share it by offload/onload and engine sleep/wake); two
ranks of one role may not.

    role       ranks                                             exists
    trainer    trainer.pp * dp * tp (EP is carved out of dp x tp)  always
    reference  as many as the trainer, same coordinates          when algorithm.kl_coef > 0
    rollout    rollout.num_engines * ranks per engine            always; engine k rank i is rank k * W + i,
               (W = tp, or ep when ep > 1)                       W the ranks per engine
    reward     reward.workers                                    always

Reward workers: rule verifiers (exact_match, math_verify) are CPU processes. On device_type cpu every
process stands on a device anyway, so they take a device like any rank; on cuda/npu they need no
accelerator and get none (`DeviceMap.unplaced`: plain CPU actors, no bundle) unless their devices are
listed. A reward model (kind: model) is placed like any role.

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

Ray: one STRICT_PACK placement group per node, one bundle per device (`placement_bundles`). An actor
goes to its device's bundle; when k role ranks share a device each takes 1/k of the device resource
and of the bundle's CPUs (`actor_options`), so co-located actors fit in one bundle.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from rlhf.config.schema import DeviceType, PlacementConfig, RewardKind, RunConfig
from rlhf.config.validate import ConfigError, Problem
from weight_sync.inference_spec import InferenceLayout
from weight_sync.layout import Layout
from weight_sync.plan import DTYPE_BYTES, Topology

ROLES = ("trainer", "reference", "rollout", "reward")
DEVICES_SYNTAX = 'write global device indices (node * devices_per_node + local index) as "0-3", "0,2" or "0-1,4-5"'
# Resource names Ray fills from the hardware it detects (or reserves): a bundle asking for them on a machine
# without such devices never schedules, and on one with them it would claim real accelerators.
RAY_RESERVED = ("CPU", "GPU", "NPU", "TPU", "HPU", "memory", "object_store_memory")
ACCELERATOR = {DeviceType.cuda: "GPU", DeviceType.npu: "NPU"}
GIB = 1 << 30


# --- parsing device lists ---

def parse_devices(text: str, key: str = "devices") -> tuple[int, ...]:
    """"0-3" -> (0, 1, 2, 3); "0,2" -> (0, 2); "0-1,4-5" -> (0, 1, 4, 5); "" -> (). Order is kept (it is
    rank order). Raises ConfigError naming `key`."""
    devices, problem = _parse(text, key)
    if problem is not None:
        raise ConfigError(str(problem))
    return devices


def _parse(text: str, key: str) -> tuple[tuple[int, ...], Problem | None]:
    text = str(text).strip()
    if not text:
        return (), None
    out: list[int] = []
    for item in text.split(","):
        lo, dash, hi = item.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            return (), Problem(key, text, f"cannot read {item.strip()!r}; {DEVICES_SYNTAX}")
        if b < a:
            return (), Problem(key, text, f"range {item.strip()!r} runs backwards; write the low index first: "
                                          f"{DEVICES_SYNTAX}")
        if b - a > 1_000_000:
            return (), Problem(key, text, f"range {item.strip()!r} is larger than any cluster; {DEVICES_SYNTAX}")
        out.extend(range(a, b + 1))
    return tuple(out), None


def format_devices(devices: Sequence[int]) -> str:
    """The inverse of `parse_devices`: (0, 1, 2, 3, 6) -> "0-3,6" (runs of consecutive indices, order kept)."""
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _runs(devices))


def _runs(values: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _short(values: Sequence[int], max_runs: int = 6) -> str:
    """Like `format_devices`, shortened for long lists: a strided pattern is written once, others cut."""
    runs = _runs(values)
    if len(runs) <= max_runs:
        return format_devices(values)
    span = {b - a for a, b in runs}
    strides = {runs[i + 1][0] - runs[i][0] for i in range(len(runs) - 1)}
    one = lambda r: f"{r[0]}" if r[0] == r[1] else f"{r[0]}-{r[1]}"  # noqa: E731
    if len(span) == 1 and len(strides) == 1:
        return f"{one(runs[0])},{one(runs[1])},...,{one(runs[-1])} (every {strides.pop()})"
    return f"{','.join(one(r) for r in runs[:3])},...,{one(runs[-1])} ({len(values)} in all)"


# --- what each role needs ---

@dataclass(frozen=True)
class RoleNeed:
    role: str
    ranks: int
    why: str  # where the count comes from, for messages: "trainer.pp * dp * tp = 1 * 2 * 1 = 2"
    placed: bool  # needs devices (False: rule verifiers on cuda/npu with no devices listed)


def trainer_layout(cfg: RunConfig) -> Layout:
    t = cfg.trainer
    return Layout(pp=t.pp, dp=t.dp, tp=t.tp, ep=t.ep, experts_over_tp_ep=t.experts_over_tp_ep)


def inference_layout(cfg: RunConfig) -> InferenceLayout:
    r = cfg.rollout
    return InferenceLayout(tp=r.tp, ep=r.ep, engines=r.num_engines)


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
        il = inference_layout(cfg)
    except ValueError as e:
        problems.append(Problem("rollout.ep", r.ep, str(e)))
    else:
        per_engine = il.ranks_per_engine
        what = f"tp = {r.tp}" if r.ep == 1 else f"ep = {r.ep} (data-parallel attention over ep / tp groups)"
        needs.append(RoleNeed("rollout", il.world_size, f"rollout.num_engines * ranks per engine = {r.num_engines} * "
                                                        f"{per_engine}, ranks per engine being {what}", True))
    if w.workers < 1:
        problems.append(Problem("reward.workers", w.workers, "must be >= 1 (a step's samples are split over them)"))
    else:
        placed = p.device_type is DeviceType.cpu or w.kind is RewardKind.model or bool(str(p.reward.devices).strip())
        needs.append(RoleNeed("reward", w.workers, f"reward.workers = {w.workers}", placed))
    return needs, problems, per_engine


def role_ranks(cfg: RunConfig) -> dict[str, int]:
    """Rank count of every role this run has, placed on devices or not."""
    return {n.role: n.ranks for n in _needs(cfg)[0]}


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
        lines = "\n  ".join(str(p) for p in problems)
        raise ConfigError(f"invalid placement ({len(problems)} problem{'s' * (len(problems) > 1)}):\n  {lines}")
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
        problem = _parse(getattr(p, role).devices, f"placement.{role}.devices")[1]
        if problem is not None:
            out.append(problem)
    return out


def _default(role: str, ranks: int, chosen: dict[str, tuple[int, ...]], colocate: bool) -> tuple[int, ...]:
    if role == "reference" and "trainer" in chosen:
        return chosen["trainer"]
    start = 0
    if not colocate and role == "rollout" and chosen.get("trainer"):
        start = max(chosen["trainer"]) + 1
    if not colocate and role == "reward" and chosen.get("rollout"):
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
        devices, bad_syntax = _parse(text, "")
        if bad_syntax is not None:  # reported by cluster_problems
            continue
        default = not devices
        if default:
            devices = _default(need.role, need.ranks, chosen, p.colocate)
        chosen[need.role] = devices
        problems += _role_problems(cfg, need, devices, text, default, per_engine)
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
    said = (f"the default policy (colocate: {str(p.colocate).lower()}) gives devices {_short(devices)}; "
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
        out.append(Problem(key, text, f"{said}device(s) {_short(outside)} are outside the cluster, whose devices are "
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


# --- Ray: bundles and actor options ---

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


# --- weight sync topology ---

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


# --- memory estimate ---

_EXPERT_BUFFERS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


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


def memory_estimate(cfg: RunConfig, dm: DeviceMap, trainer_spec=None, engine_spec=None) -> dict[int, dict[str, int]]:
    """An estimate of the bytes each role rank keeps on its device, per device (see `memory_notes`).
    `trainer_spec` (ranks from 0) and `engine_spec` (ranks from W) are built when not given."""
    from rlhf.model.shapes import count_params
    from rlhf.model.sharding import trainer_shard_spec, zero3_axis
    from weight_sync.inference_spec import engine_shard_spec

    m, p = cfg.model, cfg.placement
    zero3 = cfg.trainer.zero_stage == 3
    lay, il = trainer_layout(cfg), inference_layout(cfg)
    W = lay.world_size
    src = trainer_spec if trainer_spec is not None else trainer_shard_spec(m, lay, zero_stage=cfg.trainer.zero_stage)
    dst = engine_spec if engine_spec is not None else engine_shard_spec(m, il, rank_offset=W)
    pbytes, rbytes = DTYPE_BYTES[m.dtype.value], DTYPE_BYTES[cfg.rollout.dtype.value]
    expert_replicas = lay.plane // lay.expert_shards
    out: dict[int, dict[str, int]] = {d: {} for d in dm.used_devices()}

    def trainer_bytes(buffers) -> tuple[int, int]:
        params = sum(_numel(s) for _, s in buffers)
        # AdamW: fp32 master slice + exp_avg + exp_avg_sq, sharded over the parameter's replicas (ZeRO-1);
        # zero_stage=3 buffers are already this rank's rows
        def replicas(name: str) -> int:
            if zero3 and zero3_axis(name):
                return 1
            return expert_replicas if name.endswith(_EXPERT_BUFFERS) else lay.dp

        opt = sum(-(-12 * _numel(s) // replicas(name)) for name, s in buffers)
        return params * pbytes, 2 * params * pbytes + opt  # (reference: params; trainer: params + grads + opt)

    memo: dict[int, tuple[int, int]] = {}
    has_ref = "reference" in dm.role_names
    for rs in src.ranks:
        b = memo.get(id(rs.buffers)) or memo.setdefault(id(rs.buffers), trainer_bytes(rs.buffers))
        out[dm.devices_of("trainer")[rs.rank]]["trainer"] = b[1]
        if has_ref:
            out[dm.devices_of("reference")[rs.rank]]["reference"] = b[0]
    if p.device_type is DeviceType.cpu:
        kv = cfg.rollout.cpu_kv_cache_gib * GIB
    else:
        kv = None  # vLLM takes gpu_memory_utilization of the device for weights + KV: sized below when known
    budget = int(cfg.rollout.gpu_memory_utilization * p.device_memory_gib * GIB)
    rollout = dm.devices_of("rollout")
    for rs in dst.ranks:
        weights = sum(_numel(s) for _, s in rs.buffers) * rbytes
        out[rollout[rs.rank - W]]["rollout"] = weights + kv if kv is not None else max(weights, budget)
    reward = dm.devices_of("reward")
    per_worker = count_params(m) * pbytes if cfg.reward.kind is RewardKind.model else 0
    for d in reward:
        out[d]["reward"] = per_worker
    return out


def memory_notes(cfg: RunConfig) -> list[str]:
    """The assumptions behind `memory_estimate`, for the printout."""
    p, r = cfg.placement, cfg.rollout
    notes = [f"trainer: its shards ({cfg.model.dtype.value}) + grads (same dtype) + AdamW fp32 master and two "
             f"moments split over the replicas (ZeRO-1: dense / dp, experts / expert replicas); activations "
             f"not included" if cfg.trainer.zero_stage == 1 else
             f"trainer: its row shards (zero_stage=3: dense / dp, experts / expert replicas; {cfg.model.dtype.value}) "
             f"+ grads + AdamW fp32 master and two moments of those rows; the largest unit's gathered "
             f"parameters and activations not included",
             "reference: its shards only (same layout as the trainer)" if cfg.algorithm.kl_coef > 0 else
             "reference: none (algorithm.kl_coef = 0)"]
    if p.device_type is DeviceType.cpu:
        notes.append(f"rollout: the engine rank's vLLM buffers ({r.dtype.value}) + its KV cache "
                     f"rollout.cpu_kv_cache_gib = {r.cpu_kv_cache_gib} GiB")
    elif p.device_memory_gib > 0:
        notes.append(f"rollout: vLLM claims rollout.gpu_memory_utilization * placement.device_memory_gib = "
                     f"{r.gpu_memory_utilization} * {p.device_memory_gib} GiB for weights + KV cache (more if the "
                     f"weights alone exceed it)")
    else:
        notes.append(f"rollout: the engine rank's vLLM buffers ({r.dtype.value}) only; vLLM also claims "
                     f"rollout.gpu_memory_utilization = {r.gpu_memory_utilization} of the device for KV cache: set "
                     f"placement.device_memory_gib to include it")
    notes.append(f"reward: {cfg.reward.kind.value}: " + ("the policy's shape, whole, per worker (an assumption)"
                                                       if cfg.reward.kind is RewardKind.model else "no device memory"))
    notes.append("co-located roles time-share a device: 'all' adds every resident role (nothing offloaded), "
                 "'peak' is the largest one (the others offloaded while it runs)")
    return notes


# --- the `rlhf plan` report ---

def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _span(lo: int, hi: int) -> str:
    return f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"


def _label(cfg: RunConfig, lay: Layout, il: InferenceLayout, role: str, rank: int) -> str:
    E = cfg.model.num_experts
    if role in ("trainer", "reference"):
        c = lay.coords(rank)
        experts = lay.experts(rank, E)
        where = f"pp{c.pp} dp{c.dp} tp{c.tp}" + (f", experts {format_devices(experts)}" if len(experts) < E else "")
        return f"{role} r{rank} ({where})"
    if role == "rollout":
        k, i = divmod(rank, il.ranks_per_engine)
        where = (f"dp{i // il.tp} " if il.attention_dp > 1 else "") + f"tp{i % il.tp}"
        if il.ep > 1:
            per = E // il.ep
            where += f", experts {i * per}-{(i + 1) * per - 1}"
        return f"rollout e{k} r{i} ({where})"
    return f"{role} w{rank}"


def _role_line(cfg: RunConfig, dm: DeviceMap, lay: Layout, il: InferenceLayout, role: str) -> str:
    if role in ("trainer", "reference"):
        what = f"{lay.world_size} ranks, {lay}"
    elif role == "rollout":
        W = il.ranks_per_engine
        what = (f"{il.engines} engine{'s' * (il.engines > 1)} x {W} rank{'s' * (W > 1)} (tp{il.tp}"
                + (f" ep{il.ep}" if il.ep > 1 else "") + ")")
    else:
        what = f"{cfg.reward.workers} worker{'s' * (cfg.reward.workers > 1)} ({cfg.reward.kind.value})"
    devices = dm.devices_of(role)
    if not devices:
        return f"  {role:<9} {what}: CPU-only actors, no device"
    nodes = sorted({dm.node_of(d) for d in devices})
    return (f"  {role:<9} {what}: device{'s' * (len(devices) > 1)} {_short(devices)} "
            f"(node{'s' * (len(nodes) > 1)} {_short(nodes)})")


def plan_report(cfg: RunConfig, dm: DeviceMap | None = None, detail_up_to: int = 16) -> tuple[list[str], dict]:
    """Lines describing the device map, the memory estimate and the weight-sync plan, and a summary dict
    (the JSON line of `rlhf plan`). Devices are listed one by one up to `detail_up_to` used devices, grouped
    beyond. Plans the sync (seconds for a 718B model); starts nothing."""
    from rlhf.model.sharding import trainer_shard_spec
    from weight_sync.inference_spec import engine_shard_spec
    from weight_sync.plan import plan_reshard

    dm = dm if dm is not None else device_map(cfg)
    p, m = cfg.placement, cfg.model
    lay, il = trainer_layout(cfg), inference_layout(cfg)
    W = lay.world_size
    src = trainer_shard_spec(m, lay, zero_stage=cfg.trainer.zero_stage)
    dst = engine_shard_spec(m, il, rank_offset=W)
    memory = memory_estimate(cfg, dm, src, dst)
    topology = transfer_topology(cfg, dm)
    t0 = time.perf_counter()
    plan = plan_reshard(src, dst, topology)
    plan_seconds = time.perf_counter() - t0
    summary = plan.summary(topology)

    fabric = (f"fabric domains of {p.nodes_per_fabric} nodes at {p.fabric_gbytes_per_s:g} GB/s per device, "
              f"{p.cross_fabric_gbytes_per_s:g} GB/s across" if p.nodes_per_fabric and p.nodes_per_fabric < p.nodes
              else f"one fabric domain at {p.fabric_gbytes_per_s:g} GB/s per device per direction")
    bundle = ", ".join(f"{v:g} {k}" for k, v in placement_bundles(p)[0][0].items())
    lines = [f"cluster: {p.nodes} node{'s' * (p.nodes > 1)} x {p.devices_per_node} {p.device_type.value} devices "
             f"= {dm.num_devices} ({fabric}); Ray bundle per device: {bundle}",
             f"roles (defaults for unlisted roles: colocate = {str(p.colocate).lower()}):"]
    lines += [_role_line(cfg, dm, lay, il, role) for role in dm.role_names]

    used = dm.used_devices()
    label = lambda d: " | ".join(_label(cfg, lay, il, role, rank) for role, rank in dm.residents(d))  # noqa: E731
    if len(used) <= detail_up_to:
        lines.append("device map:")
        lines += [f"  device {d} (node {dm.node_of(d)}): {label(d)}" for d in used]
    else:
        groups: dict[tuple[str, ...], list[int]] = {}
        for d in used:
            groups.setdefault(tuple(role for role, _ in dm.residents(d)), []).append(d)
        lines.append(f"device map ({len(used)} devices used of {dm.num_devices}, grouped by resident roles; "
                     f"first and last device of each group):")
        for roles, devices in groups.items():
            lines.append(f"  {' + '.join(roles)}: {len(devices)} devices {_short(devices)}")
            for d in sorted({devices[0], devices[-1]}):
                lines.append(f"    device {d} (node {dm.node_of(d)}): {label(d)}")
    idle = dm.num_devices - len(used)
    if idle:
        lines.append(f"  {idle} device{'s' * (idle > 1)} hold no role")

    lines += _memory_lines(cfg, memory, detail_up_to)

    devices_of_rank = transfer_devices(dm)
    same_device = sum(sum(t.numel for t in ts) for (s, d), ts in plan.pairs
                      if not ts[0].local and devices_of_rank[s] == devices_of_rank[d]) * plan.dtype_bytes
    lines += [f"weight sync plan (one transfer group: trainer ranks {_span(0, W)} -> engine ranks "
              f"{_span(W, W + il.world_size)}):",
              f"  bytes: {_bytes(plan.bytes_minimal)} written ({plan.dtype_bytes} B per element), "
              f"{_bytes(plan.bytes_network)} sent between processes, of which {_bytes(same_device)} between "
              f"processes on the same device (co-located roles)",
              f"  busiest rank: sends {_bytes(summary['max_send_bytes'])}, receives "
              f"{_bytes(summary['max_recv_bytes'])}; floor {summary['floor_seconds']:.3g} s at "
              f"{p.fabric_gbytes_per_s:g} GB/s per link",
              f"  {summary['transfers']} transfers over {summary['rank_pairs']} rank pairs, planned in "
              f"{plan_seconds:.2f} s"]

    totals = [sum(roles.values()) for roles in memory.values()] or [0]
    peaks = [max(roles.values(), default=0) for roles in memory.values()] or [0]
    result = {"devices": dm.num_devices, "devices_used": len(used),
              "roles": {role: dm.ranks_of(role) for role in dm.role_names},
              "memory_max_bytes": max(totals), "memory_max_peak_bytes": max(peaks),
              "bytes_minimal": plan.bytes_minimal, "bytes_network": plan.bytes_network,
              "bytes_same_device": same_device, "floor_seconds": summary["floor_seconds"],
              "plan_seconds": round(plan_seconds, 3)}
    return lines, result


def _memory_lines(cfg: RunConfig, memory: dict[int, dict[str, int]], detail_up_to: int) -> list[str]:
    limit = cfg.placement.device_memory_gib * GIB
    fit = f", device memory {_bytes(limit)}" if limit else ""
    lines = [f"memory per device (an estimate{fit}):"]

    def one(roles: dict[str, int]) -> str:
        total, peak = sum(roles.values()), max(roles.values(), default=0)
        parts = " + ".join(f"{role} {_bytes(b)}" for role, b in roles.items())
        over = " DOES NOT FIT" if limit and peak > limit else (" fits only with offload" if limit and total > limit
                                                                  else "")
        return f"{parts} = all {_bytes(total)}, peak {_bytes(peak)}{over}"

    if len(memory) <= detail_up_to:
        lines += [f"  device {d}: {one(roles)}" for d, roles in memory.items()]
    else:
        groups: dict[tuple, list[int]] = {}
        for d, roles in memory.items():
            groups.setdefault(tuple(roles.items()), []).append(d)
        ranked = sorted(groups.items(), key=lambda g: -sum(b for _, b in g[0]))
        for key, devices in ranked[:6]:
            lines.append(f"  {len(devices)} device{'s' * (len(devices) > 1)} {_short(devices, 3)}: {one(dict(key))}")
        if len(ranked) > 6:
            lines.append(f"  ... {len(ranked) - 6} more groups with less memory")
    lines += [f"  - {note}" for note in memory_notes(cfg)]
    return lines
