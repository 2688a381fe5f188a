"""The memory model: what each role keeps resident on its busiest device, from shapes alone (`ModelCost`), a
candidate's layouts and the hardware. Pure Python over numbers. The one model both `rlhf simulate` (and its
search) and `rlhf plan` (`rlhf.placement.device_memory`, per device of a placement) count memory with.

    state      a trainer rank's parameters, gradients and AdamW state (`trainer_state_bytes`); the reference's
               parameters; an engine rank's weights (`engine_rank_params`): tensor for tensor what the shard specs
               hold (tests/unit/rlhf/sim/test_memory_agreement.py walks them, buffer by buffer, against this)
    beyond     the activations of the micro-batches 1F1B keeps in flight, the LM head's logits chunk, ZeRO-3's
               gathered layer (`trainer_memory`); the engines' KV cache (`engine_memory`); each process's runtime
               (the hardware file's runtime_gib, `memory_per_device`)

A trainer rank holds its pipeline stage's layers (stages split as `rlhf.sharding.layout.Layout.stage_layers` splits them),
the embedding on the first stage, the final norm, the LM head and the MTP modules (frozen) on the last; attention
and MLPs split over tp, the layer norms, the router and MLA's latent projections whole on every TP rank, the
embedding and the LM head whole too (the trainer's head is not vocabulary-parallel). AdamW keeps an fp32 master and
two moments of what is stepped, each parameter's split over the ranks that hold identical copies of it (ZeRO-1:
`rlhf.parallel.optim`): dp for most, the whole stage for what the stage's gradients are summed over, the expert
replicas for routed experts. An engine rank holds the same layer tensors the same way (no MTP), the vocabulary
padded to a multiple of 64 and split over tp, its experts over ep (or every expert's FFN over tp when ep = 1).
"""

from __future__ import annotations

import functools
import math

from rlhf.sharding.layout import Layout, padded_vocab
from rlhf.sim.candidate import Candidate, EngineChoice, TrainerChoice
from rlhf.sim.hardware import Hardware
from rlhf.sim.workload import ModelCost, Workload

GIB = float(1 << 30)
LOGIT_CHUNK = 1024  # the fused LM head's token chunk (rlhf/model/head.py)
ADAMW_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per stepped element


def stage_layers(mc: ModelCost, pp: int) -> tuple[tuple[int, int], ...]:
    """(dense layers, MoE layers) of each pipeline stage: the first layers / pp + 1 on the first stages, as
    `rlhf.sharding.layout.Layout.stage_layers` splits them; the dense layers come first."""
    return _split(mc.layers, mc.dense_layers, pp)


@functools.lru_cache(maxsize=1024)
def _split(layers: int, dense_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    out = []
    for r in Layout(pp=pp).stage_layers(layers):  # the trainer's split; the dense layers come first
        dense = max(0, min(r.stop, dense_layers) - r.start)
        out.append((dense, len(r) - dense))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _busiest_candidates(layers: int, dense_layers: int, pp: int) -> tuple[int, ...]:
    """The stages that can be a trainer's busiest: the first (embedding, the most micro-batches in flight), the
    last (head, MTP) and the first stage of each distinct layer split (later stages with the same split hold
    the same state and fewer micro-batches in flight). The search costs thousands of layouts: pp up to the
    layer count would make every stage a quadratic cost."""
    split = _split(layers, dense_layers, pp)
    first: dict[tuple[int, int], int] = {}
    for s, layers_s in enumerate(split):
        first.setdefault(layers_s, s)
    return tuple(sorted({0, pp - 1, *first.values()}))


def trainer_stage_params(mc: ModelCost, t: TrainerChoice, stage: int) -> tuple[dict, dict]:
    """(stepped, frozen) elements one trainer rank of `stage` holds, each by the ranks holding identical copies:
    'dp' (the DP group: AdamW state split over it; ZeRO-3 splits their rows over it), 'stage' (every rank of the
    stage: state split over dp x tp; never row-split), 'expert' (routed experts: over the expert replicas).
    Frozen: the router's correction bias, the MTP modules."""
    pp, tp, expert_shards = t.pp, t.tp, t.expert_shards
    dense_layers, moe_layers = stage_layers(mc, pp)[stage]
    per_shard = mc.num_experts // expert_shards * mc.expert
    kv_split = min(tp, max(1, mc.kv_heads))
    stepped = {"dp": 0.0, "stage": 0.0, "expert": moe_layers * per_shard}
    frozen = {"dp": 0.0, "stage": 0.0, "expert": 0.0}
    for n, lp in ((dense_layers, mc.dense_layer), (moe_layers, mc.moe_layer)):
        stepped["dp"] += n * (lp.split / tp + lp.kv / kv_split + lp.replicated)
        stepped["stage"] += n * lp.stage
        frozen["stage"] += n * lp.frozen
    if stage == 0:
        stepped["dp"] += mc.embed
    if stage == pp - 1:
        stepped["dp"] += mc.head + mc.final_norm
        lp = mc.mtp_layer
        frozen["dp"] += mc.mtp_layers * (lp.split / tp + lp.kv / kv_split + lp.replicated)
        frozen["stage"] += mc.mtp_layers * (lp.stage + lp.frozen)
        frozen["expert"] += mc.mtp_layers * per_shard
    return stepped, frozen


def trainer_state_bytes(mc: ModelCost, t: TrainerChoice, nbytes: int, stage: int | None = None) -> float:
    """Parameters, gradients and AdamW state of a trainer rank of `stage` (default: the busiest stage's).
    ZeRO-1: every held parameter, a gradient of each stepped one, the state split over its copies. ZeRO-3:
    the row shards (over dp; experts over their replicas; what the stage shares stays whole, its state as
    ZeRO-1's), gradients and state of those rows; the gathered layer is `trainer_memory`'s."""
    if stage is None:
        return max(trainer_state_bytes(mc, t, nbytes, s) for s in _busiest_candidates(mc.layers, mc.dense_layers, t.pp))
    stepped, frozen = trainer_stage_params(mc, t, stage)
    replicas_e = max(1, t.dp * t.tp // t.expert_shards)
    state = stepped["dp"] / t.dp + stepped["stage"] / (t.dp * t.tp) + stepped["expert"] / replicas_e
    return (2 * _held(stepped, t) + _held(frozen, t)) * nbytes + ADAMW_BYTES * state


def _held(p: dict, t: TrainerChoice) -> float:
    """Elements of `p` (`trainer_stage_params`) a rank holds: all, or with ZeRO-3 its rows of the row-split."""
    if t.zero_stage != 3:
        return p["dp"] + p["stage"] + p["expert"]
    return p["dp"] / t.dp + p["stage"] + p["expert"] / max(1, t.dp * t.tp // t.expert_shards)


def trainer_memory(mc: ModelCost, w: Workload, t: TrainerChoice) -> float:
    """Bytes on the busiest trainer device: `trainer_state_bytes` plus the activations of the micro-batches
    1F1B keeps in flight on its stage (pp - stage of them; with recompute each layer's input only, and the
    layer being recomputed whole), the LM head's logits chunk and, with ZeRO-3, one layer gathered whole."""
    nb = w.train_bytes
    per_dp = w.train_samples * w.sequence / t.dp
    micro = max(1, math.ceil(per_dp / t.micro_batch_tokens))
    mb = min(per_dp, t.micro_batch_tokens)
    per_layer = mc.hidden if t.recompute else mc.act_per_token_layer / t.tp
    logits = min(mb, LOGIT_CHUNK) * mc.vocab * 4 * 3  # the head's chunk (whole vocabulary): logits, their exp, grad
    layer = max(mc.dense_layer.on_rank(t.tp, mc.kv_heads), mc.moe_layer.on_rank(t.tp, mc.kv_heads)
                + mc.num_experts // t.expert_shards * mc.expert)
    best = 0.0
    split = stage_layers(mc, t.pp)
    for s in _busiest_candidates(mc.layers, mc.dense_layers, t.pp):
        dense, moe = split[s]
        act = mb * nb * (dense + moe) * per_layer * min(t.pp - s, micro)
        if t.recompute:
            act += mb * nb * mc.act_per_token_layer / t.tp
        gathered = layer * nb if t.zero_stage == 3 else 0.0
        best = max(best, trainer_state_bytes(mc, t, nb, s) + act + gathered + logits)
    return best


def reference_state_bytes(mc: ModelCost, t: TrainerChoice, nbytes: int, stage: int | None = None) -> float:
    """The reference's parameters on a rank of `stage` (default: its busiest rank's): the trainer's layout and
    shards, nothing stepped."""
    stages = _busiest_candidates(mc.layers, mc.dense_layers, t.pp) if stage is None else (stage,)
    return max(sum(_held(p, t) for p in trainer_stage_params(mc, t, s)) for s in stages) * nbytes


def reference_memory(mc: ModelCost, w: Workload, t: TrainerChoice) -> float:
    return reference_state_bytes(mc, t, w.train_bytes) if w.reference else 0.0


def engine_rank_params(mc: ModelCost, e: EngineChoice) -> float:
    """Parameters one engine rank holds: the padded vocabulary (embedding and head) over tp, attention, dense
    and shared MLPs over tp, norms, routers and MLA's latent projections whole; experts (with the redundant
    copies) over ep, or every expert's FFN over tp when ep == 1. No MTP modules."""
    vocab = padded_vocab(mc.vocab, e.tp) // e.tp * mc.hidden * (1 + (mc.head > 0))
    layers = (mc.dense_layers * mc.dense_layer.on_rank(e.tp, mc.kv_heads)
              + mc.moe_layers * mc.moe_layer.on_rank(e.tp, mc.kv_heads))
    if e.ep > 1:
        expert = mc.moe_layers * (mc.num_experts + e.redundant_experts) / e.ep * mc.expert
    else:
        expert = mc.expert_total / e.tp
    return vocab + mc.final_norm + layers + expert


def engine_rank_weight_bytes(mc: ModelCost, e: EngineChoice, rollout_bytes: float, quant_bytes: float = 0.0) -> float:
    """Bytes of an engine rank's weights: the vocabulary (embedding, head) at `rollout_bytes`, everything else at
    `quant_bytes` when the engines quantize (`rollout.quantization`; their norms and routers, kept plain, are
    counted with it: under 0.2 % of a layer), else at `rollout_bytes`."""
    total = engine_rank_params(mc, e)
    if not quant_bytes:
        return total * rollout_bytes
    vocab = padded_vocab(mc.vocab, e.tp) // e.tp * mc.hidden * (1 + (mc.head > 0))
    return vocab * rollout_bytes + (total - vocab) * quant_bytes


def kv_budget_bytes(hw: Hardware, w: Workload, mc: ModelCost, e: EngineChoice) -> float:
    """KV-cache bytes one engine rank has: cpu engines reserve rollout.cpu_kv_cache_gib; on an accelerator
    vLLM takes gpu_memory_utilization of the device for weights + KV."""
    if hw.device_type == "cpu":
        return w.kv_cache_gib * GIB
    return max(0.0, w.gpu_memory_utilization * hw.memory_gib * GIB
               - engine_rank_weight_bytes(mc, e, w.rollout_bytes, w.rollout_quant_bytes))


def engine_memory(mc: ModelCost, w: Workload, hw: Hardware, e: EngineChoice) -> float:
    return engine_device_bytes(engine_rank_weight_bytes(mc, e, w.rollout_bytes, w.rollout_quant_bytes), hw.device_type,
                               w.kv_cache_gib, w.gpu_memory_utilization, hw.memory_gib)


def engine_device_bytes(weights: float, device_type: str, kv_cache_gib: float, gpu_memory_utilization: float,
                        memory_gib: float) -> float:
    """An engine rank's bytes on its device from its weights: on cpu the weights and the KV cache it reserves
    (rollout.cpu_kv_cache_gib); on an accelerator vLLM claims gpu_memory_utilization of the device for weights
    and KV cache together (more where the weights alone exceed it)."""
    if device_type == "cpu":
        return weights + kv_cache_gib * GIB
    return max(weights, gpu_memory_utilization * memory_gib * GIB)


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
