"""What a placement implies for memory: the bytes each role rank keeps on each device it sits on, and the
assumptions behind them (`memory_notes`, printed by `rlhf plan`). Pure. The figures are the memory model's
(`rlhf.sim.memory`, which `rlhf simulate` prices with too), placed on the devices of this placement."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf.model.shapes import count_params
from rlhf.placement.device_map import DeviceMap
from rlhf.schema import DeviceType, RewardKind, RunConfig
from rlhf.sharding.layout import trainer_layout
from rlhf.sim.candidate import engine_choice, trainer_choice
from rlhf.sim.memory import GIB, engine_device_bytes, engine_rank_weight_bytes, reference_state_bytes, trainer_state_bytes
from rlhf.sim.workload import model_cost, quant_bytes
from weight_sync.plan import DTYPE_BYTES

__all__ = ["GIB", "RankBytes", "device_bytes", "memory_estimate", "memory_notes", "rank_bytes"]


@dataclass(frozen=True)
class RankBytes:
    """Bytes of each rank's state, by rank: trainer (params + grads + AdamW state), reference (params), engine
    rank (weights, before its KV cache). Ranks from 0 in each role."""

    trainer: tuple[int, ...]
    reference: tuple[int, ...]
    rollout_weights: tuple[int, ...]


def rank_bytes(cfg: RunConfig) -> RankBytes:
    """The state each trainer, reference and engine rank keeps, by the memory model: a trainer rank holds its
    pipeline stage's share (`trainer_state_bytes`: every buffer, a gradient of each stepped one, AdamW's fp32
    master and two moments split over the ranks holding identical copies; zero_stage=3 its rows), a reference
    rank the same parameters, an engine rank its weights."""
    mc, lay = model_cost(cfg.model), trainer_layout(cfg.trainer)
    t, e = trainer_choice(cfg.trainer), engine_choice(cfg.rollout)
    nb, rb = DTYPE_BYTES[cfg.model.dtype.value], DTYPE_BYTES[cfg.rollout.dtype.value]
    stages = [lay.coords(r).pp for r in range(lay.world_size)]
    trainer = {s: math.ceil(trainer_state_bytes(mc, t, nb, s)) for s in set(stages)}
    reference = {s: math.ceil(reference_state_bytes(mc, t, nb, s)) for s in set(stages)}
    qb = quant_bytes(cfg.rollout.quantization.value, cfg.model.hidden_size)
    weights = math.ceil(engine_rank_weight_bytes(mc, e, rb, qb))
    return RankBytes(tuple(trainer[s] for s in stages), tuple(reference[s] for s in stages),
                     (weights,) * e.world)


def memory_estimate(cfg: RunConfig, dm: DeviceMap) -> dict[int, dict[str, int]]:
    """An estimate of the bytes each role rank keeps on its device, per device (see `memory_notes`)."""
    return device_bytes(cfg, dm, rank_bytes(cfg))


def device_bytes(cfg: RunConfig, dm: DeviceMap, rb: RankBytes) -> dict[int, dict[str, int]]:
    """`memory_estimate` from the ranks' state already counted: each rank's bytes on its device, the engines'
    with their KV cache, the reward workers'."""
    p = cfg.placement
    out: dict[int, dict[str, int]] = {d: {} for d in dm.used_devices()}
    has_ref = "reference" in dm.role_names
    for rank, b in enumerate(rb.trainer):
        out[dm.devices_of("trainer")[rank]]["trainer"] = b
        if has_ref:
            out[dm.devices_of("reference")[rank]]["reference"] = rb.reference[rank]
    r = cfg.rollout
    rollout = dm.devices_of("rollout")
    for rank, weights in enumerate(rb.rollout_weights):
        out[rollout[rank]]["rollout"] = math.ceil(engine_device_bytes(
            weights, p.device_type.value, r.cpu_kv_cache_gib, r.gpu_memory_utilization, p.device_memory_gib))
    reward = dm.devices_of("reward") if "reward" in dm.role_names else ()
    per_worker = count_params(cfg.model) * DTYPE_BYTES[cfg.model.dtype.value] if cfg.reward.kind is RewardKind.model else 0
    for d in reward:
        out[d]["reward"] = per_worker
    return out


def memory_notes(cfg: RunConfig) -> list[str]:
    """The assumptions behind `memory_estimate`, for the printout."""
    p, r = cfg.placement, cfg.rollout
    notes = [f"trainer: its shards ({cfg.model.dtype.value}) + grads (same dtype) + AdamW fp32 master and two "
             f"moments split over the replicas (ZeRO-1: dense / dp, router, q/k norms and MLA latents / dp x tp, "
             f"experts / expert replicas; frozen router bias and MTP modules: no grads, no state); activations "
             f"not included" if cfg.trainer.zero_stage == 1 else
             f"trainer: its row shards (zero_stage=3: dense / dp, experts / expert replicas; {cfg.model.dtype.value}) "
             f"+ grads + AdamW fp32 master and two moments of those rows (frozen router bias and MTP modules: no "
             f"grads, no state); the largest unit's gathered parameters and activations not included",
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
    if cfg.agent.function is not None:
        notes.append(f"agent function: {cfg.agent.function}: runs on the driver's threads, no device memory")
    elif cfg.agent.enabled:
        notes.append(f"environment: {cfg.agent.environment}: no device memory (CPU processes)")
    else:
        notes.append(f"reward: {cfg.reward.kind.value}: " + ("the policy's shape, whole, per worker (an assumption)"
                                                           if cfg.reward.kind is RewardKind.model else "no device memory"))
    notes.append("co-located roles time-share a device: 'all' adds every resident role (nothing offloaded), "
                 "'peak' is the largest one (the others offloaded while it runs)")
    return notes
