"""The cost model of one RL step: seconds per phase and memory per device, composed from operators over
shapes, layouts and a hardware description. Pure Python over numbers: no torch, no Ray, no plan.

Each phase's time is `scale * modelled + fixed_s * events + call_s` (its `rlhf.sim.hardware.Calibration`):
the modelled part is compute at the device's peak FLOP/s (expert matmuls at `grouped_matmul_efficiency`),
memory traffic at its bandwidth (the roofline's max of the two where a phase is memory-bound: decoding),
and messages on the link their group crosses (bandwidth and latency per message); the fixed part is what
does not scale with FLOPs or bytes (a generated token's sampling and bookkeeping, a micro-batch's launch) and
the phase's call (the driver's round trip to the roles).

    generate   per engine (all engines alike, in parallel): prefill of each prompt once (prefix cache), then
               decode steps of a batch limited by max_num_seqs and the KV cache, in waves; TP all-reduces
               and EP all-to-alls per layer and step
    reward     rule verifiers: a fixed cost per sample and worker; a reward model: a forward
    reference  a forward of every trained sample (kl_coef > 0)
    logprobs   the old-logprob forward, skipped when the update is on-policy
    update     forward + backward (+ a recomputed forward), TP all-reduces, EP all-to-alls, pipeline sends and
               bubble, DP gradient reduction (ZeRO-3: parameter gathers), the optimizer step (memory-bound)
    sync       every engine rank receives its shard (rollout dtype) from the trainer ranks, busiest rank's
               bytes on the link between the pools, then installs it (a copy at memory bandwidth)
    offload    co-located on an accelerator: the trainer's state to host and back, engines asleep and awake
    driver     the driver's own work per step (advantages, batching, its calls to the roles): a fixed cost

The step: co-located phases run one after the other; disaggregated pools with a staleness bound >= 1
overlap generation (+ reward) with training, the sync waits for both (`step_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf.layout import InferenceLayout, Layout
from rlhf.sim.hardware import Hardware
from rlhf.sim.workload import ModelCost, Workload

GIB = float(1 << 30)
LOGIT_CHUNK = 1024  # the fused LM head's token chunk (rlhf/model/head.py)


@dataclass(frozen=True)
class TrainerChoice:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    experts_over_tp_ep: bool = False
    zero_stage: int = 1
    recompute: bool = False  # attention and experts recomputed in backward
    micro_batch_tokens: int = 4096
    hierarchical_ep: bool = False  # the expert all-to-all in two hops (inter-node once per node, then inside)

    # world and expert_shards are rlhf.layout.Layout's rules, inlined: the search reads them per candidate
    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def expert_shards(self) -> int:
        return self.ep * self.tp if self.experts_over_tp_ep else self.ep

    def __str__(self) -> str:
        lay = Layout(self.pp, self.dp, self.tp, self.ep, self.experts_over_tp_ep)
        return (f"{lay}" + (f" zero{self.zero_stage}" if self.zero_stage != 1 else "")
                + (" recompute" * self.recompute) + f" mb{self.micro_batch_tokens}"
                + (" hierarchical-ep" * self.hierarchical_ep))


@dataclass(frozen=True)
class EngineChoice:
    tp: int = 1
    ep: int = 1
    engines: int = 1
    redundant_experts: int = 0

    @property
    def ranks(self) -> int:  # rlhf.layout.InferenceLayout.ranks_per_engine, inlined (read per candidate)
        return self.tp if self.ep == 1 else self.ep

    @property
    def world(self) -> int:
        return self.ranks * self.engines

    def __str__(self) -> str:
        return str(InferenceLayout(self.tp, self.ep, self.engines, self.redundant_experts))


@dataclass(frozen=True)
class Candidate:
    """One configuration: the two layouts, where they sit, and the loop's staleness bound."""

    trainer: TrainerChoice
    engines: EngineChoice
    colocated: bool = True
    trainer_devices: int = 0  # devices of the trainer pool (0: the trainer's world size)
    rollout_devices: int = 0
    staleness: int = 0

    @property
    def devices(self) -> int:
        t = self.trainer_devices or self.trainer.world
        r = self.rollout_devices or self.engines.world
        return max(t, r) if self.colocated else t + r

    @property
    def rollout_first_device(self) -> int:
        return 0 if self.colocated else (self.trainer_devices or self.trainer.world)

    def __str__(self) -> str:
        where = "co-located" if self.colocated else f"disaggregated {self.trainer_devices or self.trainer.world}+" \
                                                    f"{self.rollout_devices or self.engines.world}"
        return f"trainer {self.trainer}, engines {self.engines}, {where}" + (
            f", staleness {self.staleness}" if self.staleness else "")


@dataclass(frozen=True)
class Sync:
    """Weight-sync bytes when a real plan gives them (the busiest rank's, between different processes)."""

    max_recv_bytes: float
    max_send_bytes: float


class Seconds(float):
    """A phase's predicted seconds, carrying its parts before calibration: the modelled seconds, the count of
    fixed-cost events and of calls (what `rlhf.sim.fit` fits the calibration on)."""

    modelled: float
    events: float
    calls: float

    def __new__(cls, value: float, modelled: float = 0.0, events: float = 0.0, calls: float = 0.0):
        out = super().__new__(cls, value)
        out.modelled, out.events, out.calls = modelled, events, calls
        return out


NONE = Seconds(0.0)


def _phase(hw: Hardware, phase: str, modelled: float, events: float) -> Seconds:
    c = hw.calib(phase)
    return Seconds(c.scale * modelled + c.fixed_s * events + c.call_s, modelled, events, 1.0)


def _ring(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce (reduce-scatter + all-gather) of `nbytes` over n ranks."""
    return 2.0 * nbytes * (n - 1) / n if n > 1 else 0.0


# --- trainer-side ---

def trainer_params(mc: ModelCost, t: TrainerChoice) -> tuple[float, float]:
    """(dense, expert) parameters of the busiest rank: its stage's layers (the first stage also holds the
    embedding, the last the head: the larger of the two counted) split over tp, experts over the shards."""
    dense = mc.layer_dense / t.pp / t.tp + max(mc.embed, mc.head) / t.tp
    if t.pp == 1:
        dense = mc.layer_dense / t.tp + (mc.embed + mc.head) / t.tp
    expert = mc.moe_layers / t.pp * mc.num_experts / t.expert_shards * mc.expert
    return dense, expert


def ep_all_to_all_seconds(hw: Hardware, t: TrainerChoice, first_device: int, act: float, top_k: int) -> float:
    """One all-to-all of a micro-batch's token rows (`act` bytes, each row going to `top_k` experts, routing
    taken as uniform) over the EP group (`expert_shards` consecutive ranks): its members on the same node
    exchange over the node's link, the others over the slowest link the group crosses. Flat: every (token,
    expert) row goes straight to its member. Hierarchical (`t.hierarchical_ep`): a token crosses once to each
    remote node holding any of its experts, then every row whose member is not the receiving one takes a hop
    inside that node."""
    tokens = act / (t.tp if t.experts_over_tp_ep else 1)  # experts over tp x ep: each TP rank sends its share
    rows = tokens * top_k  # bytes of (token, expert) rows one rank sends
    n = t.expert_shards
    outer_level = hw.level_between(n, first_device)
    nodes = 1 if outer_level == "node" else math.ceil(n / hw.devices_per_node)
    local = max(1, n // nodes)  # EP members per node
    inner, outer = hw.link("node"), hw.link(outer_level)
    if nodes == 1:
        return inner.seconds(rows * (n - 1) / n, n - 1)
    if not t.hierarchical_ep:
        return inner.seconds(rows * (local - 1) / n, local - 1) + outer.seconds(rows * (n - local) / n, n - local)
    remote_nodes = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** top_k)  # distinct remote nodes a token reaches
    return outer.seconds(tokens * remote_nodes, nodes - 1) + inner.seconds(rows * (local - 1) / local, local - 1)


def _trainer_levels(hw: Hardware, t: TrainerChoice, first_device: int) -> tuple[str, str, str]:
    """Links of the tp, dp and pp groups (ranks: tp fastest, then dp, then pp; the EP group's levels are
    `ep_all_to_all_seconds`'s)."""
    tp = hw.level_between(t.tp, first_device)
    dp = hw.level_between(t.dp * t.tp, first_device)
    pp = hw.level_between(t.world, first_device)
    return tp, dp, pp


def _pass(mc: ModelCost, w: Workload, hw: Hardware, t: TrainerChoice, first_device: int, backward: bool,
          dtype: str, nbytes: int) -> tuple[float, float]:
    """(modelled seconds, micro-batches per rank) of one pass over the step's trained tokens."""
    tokens = w.train_samples * w.sequence
    per_dp = tokens / t.dp
    # the update runs each mini-batch (one optimizer step) as its own micro-batches; a forward pass takes all
    groups = w.mini_batches if backward else 1
    per_group = max(1, math.ceil(per_dp / groups / t.micro_batch_tokens))
    micro = groups * per_group
    mb_tokens = per_dp / micro
    flops_dense = 2.0 * tokens * (mc.head + mc.layer_dense + mc.layers * mc.attn_width * w.sequence / 2)
    flops_expert = 2.0 * tokens * mc.moe_layers * mc.top_k * mc.expert
    mult = (3.0 + (1.0 if t.recompute else 0.0)) if backward else 1.0
    peak = hw.flops(dtype)
    skew = w.expert_load_skew if t.expert_shards > 1 else 1.0
    compute = mult * (flops_dense + flops_expert * skew / hw.grouped_matmul_efficiency) / (t.world * peak)
    tp_l, dp_l, pp_l = _trainer_levels(hw, t, first_device)
    layers = mc.layers / t.pp
    moe = mc.moe_layers / t.pp
    dirs = 2.0 if backward else 1.0
    act = mb_tokens * mc.hidden * nbytes
    comm = 0.0
    if t.tp > 1:  # two all-reduces per layer forward, two backward
        comm += micro * hw.link(tp_l).seconds(2 * dirs * layers * _ring(act, t.tp), 2 * dirs * layers * 2 * (t.tp - 1))
    if t.ep > 1:  # dispatch and combine all-to-all per MoE layer (each direction)
        comm += micro * 2 * dirs * moe * ep_all_to_all_seconds(hw, t, first_device, act, mc.top_k)
    if t.pp > 1:  # activations to the next stage (and gradients back), plus the 1F1B bubble
        comm += micro * hw.link(pp_l).seconds(dirs * act, dirs)
        compute *= 1.0 + (t.pp - 1) / per_group
    if backward:  # every epoch passes over the tokens again; each optimizer step reduces gradients and steps AdamW
        compute, comm, micro = compute * w.epochs, comm * w.epochs, micro * w.epochs
        dense, expert = trainer_params(mc, t)
        replicas_e = max(1, t.dp * t.tp // t.expert_shards)
        steps = w.mini_batches * w.epochs
        comm += steps * (hw.link(dp_l).seconds(_ring(dense * nbytes, t.dp), 2 * (t.dp - 1))
                         + hw.link(dp_l).seconds(_ring(expert * nbytes, replicas_e), 2 * (replicas_e - 1)))
        if t.zero_stage == 3:  # every micro-batch gathers the rows it does not hold, forward and backward
            comm += micro * hw.link(dp_l).seconds(2 * (dense + expert) * nbytes * (t.dp - 1) / t.dp, 2 * (t.dp - 1))
        # AdamW: read and write the fp32 master, two moments, the gradient and the parameter (of its shard)
        local = dense / t.dp + expert / replicas_e
        compute += steps * local * (2 * 12 + 3 * nbytes) / (hw.memory_gbytes_per_s * 1e9)
    return compute + comm, micro


def trainer_phases(mc: ModelCost, w: Workload, hw: Hardware, t: TrainerChoice, first_device: int = 0) -> dict:
    """Seconds of the trainer's phases: reference and old logprobs (forwards), update."""
    out = {}
    dt, nb = w.train_dtype, w.train_bytes
    fwd, micro_f = _pass(mc, w, hw, t, first_device, False, dt, nb)
    out["reference"] = _phase(hw, "reference", fwd, micro_f) if w.reference else NONE
    out["logprobs"] = NONE if w.on_policy else _phase(hw, "logprobs", fwd, micro_f)
    upd, micro_u = _pass(mc, w, hw, t, first_device, True, dt, nb)
    out["update"] = _phase(hw, "update", upd, micro_u)
    return out


def trainer_memory(mc: ModelCost, w: Workload, t: TrainerChoice) -> float:
    """Bytes on the busiest trainer device: its parameters, gradients and AdamW state (fp32 master and two
    moments, split over the replicas: ZeRO-1; all of it over dp with ZeRO-3) and the activations of the
    micro-batches 1F1B keeps in flight on the first stage (with recompute: each layer's input only)."""
    dense, expert = trainer_params(mc, t)
    nb = w.train_bytes
    replicas_e = max(1, t.dp * t.tp // t.expert_shards)
    if t.zero_stage == 3:
        held = dense / t.dp + expert / replicas_e
        state = held * (2 * nb + 12)
        state += (dense + expert) / (mc.layers / t.pp) * nb  # one layer gathered whole
    else:
        state = (dense + expert) * 2 * nb + 12 * (dense / t.dp + expert / replicas_e)
    per_dp = w.train_samples * w.sequence / t.dp
    micro = max(1, math.ceil(per_dp / t.micro_batch_tokens))
    mb = min(per_dp, t.micro_batch_tokens)
    layers = mc.layers / t.pp
    per_layer = mc.hidden if t.recompute else mc.act_per_token_layer / t.tp
    act = mb * nb * layers * per_layer * min(t.pp, micro)  # 1F1B keeps up to pp micro-batches on stage 0
    if t.recompute:  # the layer being recomputed, whole, for the one micro-batch in backward
        act += mb * nb * mc.act_per_token_layer / t.tp
    logits = min(mb, LOGIT_CHUNK) * mc.vocab / t.tp * 4 * 3  # the head's chunk: logits, their exp, the grad
    return state + act + logits


def reference_memory(mc: ModelCost, w: Workload, t: TrainerChoice) -> float:
    dense, expert = trainer_params(mc, t)
    return (dense + expert) * w.train_bytes if w.reference else 0.0


# --- engine side ---

def engine_rank_params(mc: ModelCost, e: EngineChoice) -> float:
    """Parameters one engine rank holds: attention, norms, dense MLPs, embedding and head over tp; experts
    (with the redundant copies) over ep, or every expert split over tp when ep == 1."""
    dense = (mc.layer_dense + mc.embed + mc.head) / e.tp
    if e.ep > 1:
        expert = mc.moe_layers * (mc.num_experts + e.redundant_experts) / e.ep * mc.expert
    else:
        expert = mc.expert_total / e.tp
    return dense + expert


def kv_budget_bytes(hw: Hardware, w: Workload, mc: ModelCost, e: EngineChoice) -> float:
    """KV-cache bytes one engine rank has: cpu engines reserve rollout.cpu_kv_cache_gib; on an accelerator
    vLLM takes gpu_memory_utilization of the device for weights + KV."""
    if hw.device_type == "cpu":
        return w.kv_cache_gib * GIB
    return max(0.0, w.gpu_memory_utilization * hw.memory_gib * GIB - engine_rank_params(mc, e) * w.rollout_bytes)


def generate_seconds(mc: ModelCost, w: Workload, hw: Hardware, e: EngineChoice, first_device: int = 0) -> tuple[
        Seconds, dict]:
    """Seconds of one step's generation (the slowest engine) and what shaped it (batch, waves, KV limit)."""
    samples = math.ceil(w.samples / e.engines)
    prompts = math.ceil(w.prompts / e.engines)
    attn_dp = e.ranks // e.tp
    ctx_max = w.prompt_tokens + w.max_new_tokens
    kv_tok = mc.kv_per_token * mc.layers * w.rollout_bytes / e.tp  # per token on one rank (KV heads over tp)
    kv_seqs = int(kv_budget_bytes(hw, w, mc, e) * attn_dp // max(1.0, kv_tok * ctx_max))
    limit = w.max_num_seqs or 256 * e.tp * attn_dp
    batch = max(1, min(samples, limit, kv_seqs if kv_seqs > 0 else 1))
    waves = math.ceil(samples / batch)
    peak = hw.flops(w.rollout_dtype)
    # prefill: every prompt once, the group's other samples reuse it from the prefix cache
    prefill_tokens = prompts * w.prompt_tokens
    prefill = mc.forward_flops(prefill_tokens, w.prompt_tokens / 2) / (e.ranks * peak)
    steps = waves * w.response_tokens
    tokens = samples * w.response_tokens  # per engine: each is sampled, its logprob kept, its sequence scheduled
    ctx = w.prompt_tokens + w.response_tokens / 2
    per_step = 0.0
    per_wave = [batch] * (waves - 1) + [samples - batch * (waves - 1)]
    for b in per_wave:
        flops = (2.0 * b * (mc.head + mc.layer_dense + mc.layers * mc.attn_width * ctx) / e.tp / attn_dp
                 + 2.0 * b * mc.moe_layers * mc.top_k * mc.expert / e.ranks / hw.grouped_matmul_efficiency)
        # experts a decode step reads: each of the b tokens picks top_k of them
        hit = 1 - (1 - mc.top_k / mc.num_experts) ** b
        touched = (mc.num_experts + e.redundant_experts) / e.ep * hit if e.ep > 1 else mc.num_experts * hit / e.tp
        weights = ((mc.layer_dense + mc.head) / e.tp + mc.moe_layers * touched * mc.expert) * w.rollout_bytes
        kv = b / attn_dp * ctx * kv_tok
        t = max(flops / peak, (weights + kv) / (hw.memory_gbytes_per_s * 1e9))
        act = b / attn_dp * mc.hidden * w.rollout_bytes
        if e.tp > 1:
            t += hw.link(hw.level_between(e.tp, first_device)).seconds(2 * mc.layers * _ring(act, e.tp),
                                                                       2 * mc.layers * 2 * (e.tp - 1))
        if e.ep > 1:  # the busiest rank sets the pace; one redundant expert per rank evens the hottest out
            t *= 1 + (w.expert_load_skew - 1) * max(0.0, 1 - e.redundant_experts / e.ep)
            t += hw.link(hw.level_between(e.ranks, first_device)).seconds(
                2 * mc.moe_layers * act * mc.top_k * (e.ep - 1) / e.ep, 2 * mc.moe_layers * (e.ep - 1))
        per_step += t * w.response_tokens
    modelled = prefill + per_step + steps * hw.engine_step_s
    return _phase(hw, "generate", modelled, tokens), {"batch": batch, "waves": waves, "kv_seqs_max": kv_seqs}


def engine_memory(mc: ModelCost, w: Workload, hw: Hardware, e: EngineChoice) -> float:
    weights = engine_rank_params(mc, e) * w.rollout_bytes
    if hw.device_type == "cpu":
        return weights + w.kv_cache_gib * GIB
    return max(weights, w.gpu_memory_utilization * hw.memory_gib * GIB)


def reward_seconds(mc: ModelCost, w: Workload, hw: Hardware) -> Seconds:
    if w.reward_model:
        flops = mc.forward_flops(w.samples * w.sequence, w.sequence / 2)
        return _phase(hw, "reward", flops / (max(1, w.reward_workers) * hw.flops(w.train_dtype)), 0)
    return _phase(hw, "reward", 0.0, w.samples / max(1, w.reward_workers))


def sync_seconds(mc: ModelCost, w: Workload, hw: Hardware, c: Candidate, sync: Sync | None = None) -> Seconds:
    """The busiest rank's bytes over the link between the pools, then the install (a copy at memory
    bandwidth). Without a plan: every engine rank receives its shard once; the trainer ranks holding a
    parameter share its sending (balanced over the replicas)."""
    e, t = c.engines, c.trainer
    recv = engine_rank_params(mc, e) * w.rollout_bytes
    send = e.engines * engine_rank_params(mc, e) * e.ranks * w.rollout_bytes / t.world
    if sync is not None:
        recv, send = sync.max_recv_bytes, sync.max_send_bytes
    level = hw.level_between(c.devices)
    link = hw.link(level)
    transfer = link.seconds(max(recv, send), e.ranks)
    install = recv / (hw.memory_gbytes_per_s * 1e9)
    return _phase(hw, "sync", transfer + install, 1)


def offload_seconds(mc: ModelCost, w: Workload, hw: Hardware, c: Candidate) -> Seconds:
    """Co-located on an accelerator: the trainer's parameters, gradients and optimizer state go to host memory
    while the engines run and come back for the update; the engines sleep (weights to host, KV cache freed)
    and wake. Nothing moves where host and device memory are one (cpu) or the pools are apart."""
    host = hw.link("host")
    if not c.colocated:
        return NONE
    if hw.shared_memory or not host.gbytes_per_s:  # the switch still happens (the roles' calls), moving nothing
        return _phase(hw, "offload", 0.0, 1)
    dense, expert = trainer_params(mc, c.trainer)
    replicas_e = max(1, c.trainer.dp * c.trainer.tp // c.trainer.expert_shards)
    state = (dense + expert) * 2 * w.train_bytes + 12 * (dense / c.trainer.dp + expert / replicas_e)
    weights = engine_rank_params(mc, c.engines) * w.rollout_bytes
    return _phase(hw, "offload", 2 * (host.seconds(state) + host.seconds(weights)), 1)


def step_seconds(phases: dict, c: Candidate) -> float:
    """Co-located phases run one after the other (they share the devices); disaggregated pools with
    staleness >= 1 generate the next batch while the trainer trains this one, and the sync waits for both."""
    gen = phases["generate"] + phases["reward"]
    train = phases["reference"] + phases["logprobs"] + phases["update"]
    rest = phases["sync"] + phases["offload"] + phases["driver"]
    if not c.colocated and c.staleness >= 1:
        return max(gen, train) + rest
    return gen + train + rest


def memory_per_device(mc: ModelCost, w: Workload, hw: Hardware, c: Candidate) -> dict:
    """GiB per role on the busiest device of each, and the device's total: co-located roles on an accelerator
    take turns (the largest counts: the others are offloaded); on cpu every resident role counts, on the
    node's shared memory."""
    rt = hw.runtime_gib
    trainer = trainer_memory(mc, w, c.trainer) / GIB + rt.get("trainer", 0.0)
    reference = reference_memory(mc, w, c.trainer) / GIB + (rt.get("trainer", 0.0) if w.reference else 0.0)
    engine = engine_memory(mc, w, hw, c.engines) / GIB + rt.get("engine", 0.0)
    roles = {"trainer": trainer, "reference": reference, "rollout": engine}
    if hw.shared_memory:  # the node holds every process of its devices
        per_node = hw.devices_per_node
        t_dev = c.trainer_devices or c.trainer.world
        r_dev = c.rollout_devices or c.engines.world
        if c.colocated:
            total = min(per_node, t_dev) * (trainer + reference) + min(per_node, r_dev) * engine
        else:
            total = min(per_node, t_dev) * (trainer + reference) + max(0, min(per_node - min(per_node, t_dev), r_dev)) \
                * engine
        return {"roles": roles, "device": total, "node": True}
    if c.colocated:
        return {"roles": roles, "device": max(trainer, reference, engine), "node": False}
    return {"roles": roles, "device": max(trainer + reference, engine), "node": False}


def simulate_candidate(mc: ModelCost, w: Workload, hw: Hardware, c: Candidate, sync: Sync | None = None,
                       trainer: dict | None = None, generate: tuple | None = None) -> dict:
    """Every phase's seconds, the step, tokens/s and memory of one configuration. `trainer` (`trainer_phases`)
    and `generate` (`generate_seconds`) may be given when already computed for these layouts (the search)."""
    phases = dict(trainer if trainer is not None else trainer_phases(mc, w, hw, c.trainer, 0))
    gen, shape = generate if generate is not None else generate_seconds(mc, w, hw, c.engines, c.rollout_first_device)
    phases["generate"] = gen
    phases["reward"] = reward_seconds(mc, w, hw)
    phases["sync"] = sync_seconds(mc, w, hw, c, sync)
    phases["offload"] = offload_seconds(mc, w, hw, c)
    phases["driver"] = _phase(hw, "driver", 0.0, 1)  # the driver's own work and its calls, per step
    step = step_seconds(phases, c)
    mem = memory_per_device(mc, w, hw, c)
    fits = not hw.memory_gib or mem["device"] <= hw.memory_gib
    return {"step_seconds": step, "tokens_per_second": w.generated_tokens / step if step else 0.0,
            "phases": phases, "generation": shape, "memory_gib_per_device": mem["device"],
            "memory_gib_per_role": mem["roles"], "fits": fits}
