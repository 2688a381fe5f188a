"""The `rlhf plan` report: the device map, the memory estimate and the weight-sync plan of a run, as lines
for the console and one summary dict. Plans the sync (seconds for a 718B model); starts nothing. Pure.

Its memory per device (parameters, gradients, optimizer state, engine weights and KV) is the memory model's
(`rlhf.placement.device_memory` over `rlhf.sim.memory`, the one `rlhf simulate` prices with); given a hardware file's
figures (`simulate.memory_by_role`) it adds what a run holds beyond them: activations and runtime."""

from __future__ import annotations

import time

from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.model.shapes import route_bytes_per_step
from rlhf.placement.device_map import DeviceMap, device_map
from rlhf.placement.devices import abbreviate, format_devices
from rlhf.placement.device_memory import GIB, device_bytes, memory_notes, rank_bytes
from rlhf.placement.ray_slots import placement_bundles
from rlhf.placement.transfer import sync_layout
from rlhf.schema import RunConfig
from weight_sync.plan import plan_reshard


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
    elif role == "environment":
        what = f"{cfg.agent.workers} worker{'s' * (cfg.agent.workers > 1)} ({cfg.agent.environment})"
    else:
        what = f"{cfg.reward.workers} worker{'s' * (cfg.reward.workers > 1)} ({cfg.reward.kind.value})"
    devices = dm.devices_of(role)
    if not devices:
        return f"  {role:<11} {what}: CPU-only actors, no device"
    nodes = sorted({dm.node_of(d) for d in devices})
    return (f"  {role:<11} {what}: device{'s' * (len(devices) > 1)} {abbreviate(devices)} "
            f"(node{'s' * (len(nodes) > 1)} {abbreviate(nodes)})")


def plan_report(cfg: RunConfig, dm: DeviceMap | None = None, detail_up_to: int = 16,
                simulated: dict | None = None) -> tuple[list[str], dict]:
    """Lines describing the device map, the memory estimate and the weight-sync plan, and a summary dict
    (the JSON line of `rlhf plan`). Devices are listed one by one up to `detail_up_to` used devices, grouped
    beyond. `simulated`: the memory model's figures per role on a hardware file with activations, KV cache and
    runtime (`rlhf.report.simulate.memory_by_role`). Plans the sync (seconds for a 718B model); starts nothing."""

    dm = dm if dm is not None else device_map(cfg)
    p = cfg.placement
    sync = sync_layout(cfg, dm)  # the same function `rlhf train` builds its sync with
    lay, il, topology = sync.trainer, sync.engines, sync.topology
    W = lay.world_size
    src, dst = sync.src_spec(), sync.dst_spec()
    rb = rank_bytes(cfg)
    memory = device_bytes(cfg, dm, rb)
    state = {"trainer": max(rb.trainer), "rollout": max(rb.rollout_weights)}
    if "reference" in dm.role_names:
        state["reference"] = max(rb.reference)
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
    st = cfg.stale_sync
    shared = dm.shared("trainer", "rollout")
    how = ("" if not shared else "; co-located with sleeping engines: generation and training take turns on devices "
           f"{abbreviate(shared)}, host work overlaps" if cfg.rollout.sleep_level else
           f"; co-located, engines awake: both compute at once on devices {abbreviate(shared)}")
    lines.append("loop: synchronous (generate, then train, then sync)" if not st.max_staleness else
                 f"loop: StaleSync, the engines generate ahead of the trainer, samples at most {st.max_staleness} "
                 f"version(s) stale, partial rollouts {'on' if st.partial_rollout else 'off'}{how} (docs/stale_sync.md)")

    routes = None
    if cfg.captures_routes:
        m = cfg.model
        routes = route_bytes_per_step(m.num_hidden_layers - m.first_k_dense_layers, m.num_experts_per_tok,
                                      cfg.data.prompts_per_step * cfg.algorithm.group_size,
                                      cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
        lines.append(f"routes: the engines' expert choices, up to {_bytes(routes)} per step to the trainer "
                     f"(trainer.routing_replay={cfg.trainer.routing_replay.value}; docs/routing_replay.md)")

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
            lines.append(f"  {' + '.join(roles)}: {len(devices)} devices {abbreviate(devices)}")
            for d in sorted({devices[0], devices[-1]}):
                lines.append(f"    device {d} (node {dm.node_of(d)}): {label(d)}")
    idle = dm.num_devices - len(used)
    if idle:
        lines.append(f"  {idle} device{'s' * (idle > 1)} hold no role")

    lines += _memory_lines(cfg, memory, detail_up_to)
    if simulated is not None:
        lines += _simulated_lines(state, simulated)

    devices_of_rank = sync.devices
    same_device = sum(sum(t.numel for t in ts) for (s, d), ts in plan.pairs
                      if not ts[0].local and devices_of_rank[s] == devices_of_rank[d]) * plan.dtype_bytes
    nodes = sync.topology.nodes
    crossing = [((s, d), sum(t.numel for t in ts) * plan.dtype_bytes) for (s, d), ts in plan.pairs
                if nodes[s] != nodes[d]]
    cross_node = sum(b for _, b in crossing)
    lines += [f"weight sync plan (one transfer group: trainer ranks {_span(0, W)} -> engine ranks "
              f"{_span(W, W + il.world_size)}):",
              f"  bytes: {_bytes(plan.bytes_minimal)} written ({plan.dtype_bytes} B per element), "
              f"{_bytes(plan.bytes_network)} sent between processes, of which {_bytes(same_device)} between "
              f"processes on the same device (co-located roles)",
              f"  between nodes: {_bytes(cross_node)} over {len(crossing)} rank pairs"
              + (": " + ", ".join(f"{s}->{d} (node {nodes[s]}->{nodes[d]}) {_bytes(b)}" for (s, d), b in crossing[:6])
                 + (f" and {len(crossing) - 6} more" if len(crossing) > 6 else "") if crossing else ""),
              f"  busiest rank: sends {_bytes(summary['max_send_bytes'])}, receives "
              f"{_bytes(summary['max_recv_bytes'])}; floor {summary['floor_seconds']:.3g} s at "
              f"{p.fabric_gbytes_per_s:g} GB/s per link",
              f"  {summary['transfers']} transfers over {summary['rank_pairs']} rank pairs, planned in "
              f"{plan_seconds:.2f} s"]

    quantized = _quantization(sync, plan)
    if quantized is not None:
        lines += quantized[0]

    totals = [sum(roles.values()) for roles in memory.values()] or [0]
    peaks = [max(roles.values(), default=0) for roles in memory.values()] or [0]
    result = {"devices": dm.num_devices, "devices_used": len(used),
              "roles": {role: dm.ranks_of(role) for role in dm.role_names},
              "memory_max_bytes": max(totals), "memory_max_peak_bytes": max(peaks), "memory_state_max_bytes": state,
              "memory_simulated_gib_per_device": simulated,
              "bytes_minimal": plan.bytes_minimal, "bytes_network": plan.bytes_network,
              "bytes_same_device": same_device, "bytes_cross_node": cross_node, "floor_seconds": summary["floor_seconds"],
              "plan_seconds": round(plan_seconds, 3), "route_bytes_per_step": routes,
              "quantization": quantized[1] if quantized is not None else None}
    return lines, result


def _kind(name: str) -> str:
    """A tensor's kind across layers and experts: `model.layers.3.mlp.gate.weight` -> `mlp.gate`."""
    parts = [x for x in name.removesuffix(".weight").split(".") if not x.isdigit()]
    while parts and parts[0] in ("model", "layers", "experts"):
        parts = parts[1:]
    return ".".join(p for p in parts if p != "experts")


def _quantization(sync, plan) -> tuple[list[str], dict] | None:
    """`rollout.quantization`: which tensors the engines keep quantized and which plain (the rule of
    `weight_sync.quant.is_quantized`), and the sync's bytes against the same sync unquantized."""
    fmt = sync.wire_format()
    if fmt is None:
        return None
    from weight_sync.wire import WireFormat, wire_spec

    src, dst = sync.typed_specs()
    shapes = dst.shapes()
    numel = {n: _numel(s) for n, s in shapes.items()}
    quant = sorted(n for n, s in shapes.items() if fmt.quantized(n, s))
    plain_kinds = sorted({_kind(n) for n in shapes if n not in set(quant)})
    share = sum(numel[n] for n in quant) / max(sum(numel.values()), 1)
    plain = WireFormat("none", dtype=fmt.dtype)
    unquantized = plan_reshard(wire_spec(src, plain), wire_spec(dst, plain), sync.topology).bytes_minimal
    how = ("int8 with an fp32 scale a row, activations quantized per token by the engines" if fmt.per_channel else
           f"float8_e4m3fn in {fmt.block} x {fmt.block} blocks, an fp32 scale each")
    lines = [f"rollout weights: {fmt.quantization} ({how}, quantized by the trainer rank that holds them; "
             f"docs/quantized_rollout.md)",
             f"  quantized: {len(quant)} tensors, {share:.1%} of the engines' parameters "
             f"({', '.join(sorted({_kind(n) for n in quant}))})",
             f"  kept {fmt.dtype}: {', '.join(plain_kinds)}",
             f"  sync: {_bytes(plan.bytes_minimal)} written against {_bytes(unquantized)} unquantized "
             f"({plan.bytes_minimal / max(unquantized, 1):.2f}x)"]
    return lines, {"kind": fmt.quantization, "tensors": len(quant), "parameter_share": round(share, 4),
                   "kept_plain": plain_kinds, "bytes_minimal_unquantized": unquantized}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
            lines.append(f"  {len(devices)} device{'s' * (len(devices) > 1)} {abbreviate(devices, 3)}: {one(dict(key))}")
        if len(ranked) > 6:
            lines.append(f"  ... {len(ranked) - 6} more groups with less memory")
    lines += [f"  - {note}" for note in memory_notes(cfg)]
    return lines


def _simulated_lines(state: dict[str, int], simulated: dict) -> list[str]:
    """The memory model's figures for the busiest device of each role on the hardware file (`simulated`:
    `rlhf.report.simulate.memory_by_role`): the state above, and what a run adds to it."""
    lines = [f"memory per role on hardware {simulated['hardware']} (the busiest device of each role):"]
    for role, v in simulated["roles"].items():
        kv = _bytes(v.get("kv_cache", 0.0) * GIB)
        beyond = {"trainer": "with activations, the logits chunk and runtime",
                  "rollout": f"with its KV cache {kv} and runtime"}.get(role, "with runtime")
        what = "weights" if role == "rollout" else "state"
        lines.append(f"  {role:<9} {what} {_bytes(v['state'] * GIB)}; {beyond}: {_bytes(v['total'] * GIB)}")
    return lines
