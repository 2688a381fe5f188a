"""The cost model of one RL step: seconds per phase (memory per device is `rlhf.sim.memory`'s), composed from
operators over shapes, layouts and a hardware description. Pure Python over numbers: no torch, no Ray, no plan.

Each phase's time is `scale * modelled + fixed_s * events + call_s` (its `rlhf.sim.hardware.Calibration`):
the modelled part is compute at the device's peak FLOP/s (expert matmuls at `grouped_matmul_efficiency`),
memory traffic at its bandwidth (the roofline's max of the two where a phase is memory-bound: decoding),
and messages on the link their group crosses (bandwidth and latency per message); the fixed part is what
does not scale with FLOPs or bytes (a generated token's sampling and bookkeeping, a micro-batch's launch) and
the phase's call (the driver's round trip to the roles).

    generate   per engine (all engines alike, in parallel): prefill of each prompt once (prefix cache), then
               decode steps of a batch limited by max_num_seqs and the KV cache, in waves; TP all-reduces
               and EP all-to-alls per layer and step
    reward     rule verifiers: a fixed cost per sample and worker; a reward model: a forward; or the seconds per
               sample a user measured (`reward_sample_seconds`: a code sandbox, a judge), over the workers
    reference  a forward of every trained sample (kl_coef > 0)
    logprobs   the old-logprob forward, skipped when the update is on-policy
    update     forward + backward (+ a recomputed forward), TP all-reduces, EP all-to-alls, pipeline sends and
               bubble, DP gradient reduction (ZeRO-3: parameter gathers), the optimizer step (memory-bound)
    sync       every engine rank receives its shard (rollout dtype) from the trainer ranks, busiest rank's
               bytes on the link between the pools, then installs it (a copy at memory bandwidth)
    offload    co-located on an accelerator: the trainer's state to host and back, engines asleep and awake
    driver     the driver's own work per step (advantages, batching, its calls to the roles): a fixed cost

The step: synchronous phases run one after the other (streamed scoring beside the next waves' generation,
`producer_seconds`); with a staleness bound >= 1 disaggregated pools overlap
generation (+ reward) with training, the sync waits for both, and co-located roles overlap only what runs off
the devices (the reward beside the trainer's turn, the driver's work beside generation) (`step_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf.sim.candidate import Candidate, EngineChoice, TrainerChoice
from rlhf.sim.hardware import Hardware
from rlhf.sim.memory import engine_rank_weight_bytes, kv_budget_bytes, memory_per_device, trainer_state_bytes
from rlhf.sim.workload import ModelCost, Workload, quantized


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
    """(dense, expert) parameters of the busiest rank as the time model prices them (gradient reduction, the
    optimizer's pass): the average stage's layers (the first stage also holds the embedding, the last the head:
    the larger of the two counted) split over tp, experts over the shards. The exact resident figure (uneven
    stages, what stays whole on every TP rank, MTP) is `rlhf.sim.memory.trainer_state_bytes`."""
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
    read = hw.decode_weight_bytes(w.rollout_quantization, w.rollout_bytes)
    for b in per_wave:
        flops = (2.0 * b * (mc.head + mc.layer_dense + mc.layers * mc.attn_width * ctx) / e.tp / attn_dp
                 + 2.0 * b * mc.moe_layers * mc.top_k * mc.expert / e.ranks / hw.grouped_matmul_efficiency)
        # experts a decode step reads: each of the b tokens picks top_k of them
        hit = 1 - (1 - mc.top_k / mc.num_experts) ** b
        touched = (mc.num_experts + e.redundant_experts) / e.ep * hit if e.ep > 1 else mc.num_experts * hit / e.tp
        weights = ((mc.layer_dense / e.tp + mc.moe_layers * touched * mc.expert) * read
                   + mc.head / e.tp * w.rollout_bytes)  # quantized engines read 8-bit linear and expert weights
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


def reward_seconds(mc: ModelCost, w: Workload, hw: Hardware) -> Seconds:
    if w.reward_sample_seconds:  # measured by the user (a sandbox, a judge): taken as given, the workers in parallel
        return Seconds(w.reward_sample_seconds * w.samples / max(1, w.reward_workers) + hw.calib("reward").call_s)
    if w.reward_model:
        flops = mc.forward_flops(w.samples * w.sequence, w.sequence / 2)
        return _phase(hw, "reward", flops / (max(1, w.reward_workers) * hw.flops(w.train_dtype)), 0)
    return _phase(hw, "reward", 0.0, w.samples / max(1, w.reward_workers))


def sync_seconds(mc: ModelCost, w: Workload, hw: Hardware, c: Candidate, sync: Sync | None = None) -> Seconds:
    """The busiest rank's bytes over the link between the pools, then the install (a copy at memory
    bandwidth). Without a plan: every engine rank receives its shard once; the trainer ranks holding a
    parameter share its sending (balanced over the replicas)."""
    e, t = c.engines, c.trainer
    recv = engine_rank_weight_bytes(mc, e, w.rollout_bytes, w.rollout_quant_bytes)
    send = e.engines * recv * e.ranks / t.world
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
    state = trainer_state_bytes(mc, c.trainer, w.train_bytes)
    weights = engine_rank_weight_bytes(mc, c.engines, w.rollout_bytes, w.rollout_quant_bytes)
    return _phase(hw, "offload", 2 * (host.seconds(state) + host.seconds(weights)), 1)


def producer_seconds(generate: float, reward: float, waves: int = 1) -> float:
    """Generating a batch and scoring it. Scored whole, one after the other; streamed (`rollout.stream_groups`),
    each wave's groups are scored as the wave finishes, beside the next waves' generation, so only the last
    wave's scoring (or, where scoring is the slower, the first wave's generation) is left over."""
    return max(generate + reward / waves, reward + generate / waves)


def step_seconds(phases: dict, c: Candidate, waves: int = 1, shared_cores: bool = False) -> float:
    """Synchronous (staleness 0): the producer's work (`producer_seconds`), then every other phase. With a
    staleness bound >= 1 the producer generates the next batch while the trainer trains this one: disaggregated
    pools overlap the producer's work with the trainer's phases and the sync waits for both; so do co-located
    roles whose engines stay awake on cpu (`shared_cores`: the devices are the node's cores, each rank a thread
    the cores share; `shared_cores_floor` prices the sharing). Other co-located roles share the devices, so
    generation and the trainer's phases (with the sync and the switches) still follow each other there, and what
    leaves the step is the work off the devices: the reward (its own workers) beside the trainer's turn, the
    driver's bookkeeping beside generation (`rlhf.driver.turns`). The step is then the longest of the devices'
    work, the producer's and the trainer's (its turn, then the driver's). `waves`: the waves whose groups are
    scored as they finish (1 when scored whole)."""
    gen = producer_seconds(phases["generate"], phases["reward"], waves)
    train = phases["reference"] + phases["logprobs"] + phases["update"]
    rest = phases["sync"] + phases["offload"] + phases["driver"]
    if c.staleness < 1:
        return gen + train + rest
    if not c.colocated or (c.awake and shared_cores):
        return max(gen, train) + rest
    devices = phases["generate"] + train + phases["sync"] + phases["offload"]
    return max(devices, gen, train + rest)


def shared_cores_floor(phases: dict, c: Candidate, hw: Hardware) -> float:
    """cpu: stand-in devices are the node's cores (`devices_per_node`), and a placement on more stand-in devices
    than that shares them, as co-located roles whose engines stay awake share theirs. Roles overlapping under
    StaleSync there take at least their busy core-seconds (each engine rank and trainer rank a core while it
    works) over the cores, plus the phases that overlap nothing. 0 where the devices are real or the roles do
    not overlap (synchronous, or co-located taking turns)."""
    if not hw.shared_memory or c.staleness < 1 or (c.colocated and not c.awake):
        return 0.0
    if not c.colocated and c.devices <= hw.devices_per_node:
        return 0.0
    train = phases["reference"] + phases["logprobs"] + phases["update"]
    busy = phases["generate"] * c.engines.world + train * c.trainer.world + phases["reward"]
    return busy / min(c.devices, hw.devices_per_node) + phases["sync"] + phases["offload"] + phases["driver"]


def simulate_candidate(mc: ModelCost, w: Workload, hw: Hardware, c: Candidate, sync: Sync | None = None,
                       trainer: dict | None = None, generate: tuple | None = None) -> dict:
    """Every phase's seconds, the step, tokens/s and memory of one configuration. `trainer` (`trainer_phases`)
    and `generate` (`generate_seconds`) may be given when already computed for these layouts (the search)."""
    if c.quantization != w.rollout_quantization:
        w = quantized(w, c.quantization, mc.hidden)
    phases = dict(trainer if trainer is not None else trainer_phases(mc, w, hw, c.trainer, 0))
    gen, shape = generate if generate is not None else generate_seconds(mc, w, hw, c.engines, c.rollout_first_device)
    phases["generate"] = gen
    phases["reward"] = reward_seconds(mc, w, hw)
    phases["sync"] = sync_seconds(mc, w, hw, c, sync)
    phases["offload"] = offload_seconds(mc, w, hw, c)
    phases["driver"] = _phase(hw, "driver", 0.0, 1)  # the driver's own work and its calls, per step
    step = max(step_seconds(phases, c, shape["waves"] if w.streamed else 1, hw.shared_memory),
               shared_cores_floor(phases, c, hw))
    mem = memory_per_device(mc, w, hw, c)
    fits = not hw.memory_gib or mem["device"] <= hw.memory_gib
    return {"step_seconds": step, "tokens_per_second": w.generated_tokens / step if step else 0.0,
            "phases": phases, "generation": shape, "memory_gib_per_device": mem["device"],
            "memory_gib_per_role": mem["roles"], "fits": fits}
