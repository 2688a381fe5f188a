"""What a placement implies for memory: an estimate of the bytes each role rank keeps on its device, and
the assumptions behind it (`memory_notes`, printed by `rlhf plan`). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rlhf.layout import inference_layout, trainer_layout
from rlhf.model.engine_sharding import engine_shard_spec
from rlhf.model.shapes import count_params
from rlhf.model.sharding import grad_reduced_over_stage, is_frozen, trainer_shard_spec, zero3_axis
from rlhf.placement.device_map import DeviceMap
from rlhf.schema import DeviceType, RewardKind, RunConfig
from weight_sync.plan import DTYPE_BYTES

GIB = 1 << 30
_EXPERT_BUFFERS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True)
class RankBytes:
    """Shard-exact bytes of each rank's state, by rank: trainer (params + grads + AdamW state), reference
    (params), engine rank (weights, before its KV cache). Ranks from 0 in each role."""

    trainer: tuple[int, ...]
    reference: tuple[int, ...]
    rollout_weights: tuple[int, ...]


def rank_bytes(cfg: RunConfig, trainer_spec=None, engine_spec=None) -> RankBytes:
    """The state each trainer, reference and engine rank keeps, walking the shard specs (`trainer_spec` from
    rank 0 as `rlhf.model.sharding.trainer_shard_spec` builds it, `engine_spec` from rank W; built when not
    given). Trainer: every buffer; a gradient of each stepped one (not the frozen: the router's correction
    bias, the MTP modules); AdamW's fp32 master and two moments of each stepped one, split over the ranks
    holding identical copies (ZeRO-1, `rlhf.parallel.optim`: the DP group, the whole stage for what the stage's
    gradients are summed over, the expert replicas for routed experts); zero_stage=3 buffers are already
    this rank's rows."""
    m = cfg.model
    zero3 = cfg.trainer.zero_stage == 3
    lay, il = trainer_layout(cfg.trainer), inference_layout(cfg.rollout)
    W = lay.world_size
    src = trainer_spec if trainer_spec is not None else trainer_shard_spec(m, lay, zero_stage=cfg.trainer.zero_stage)
    dst = engine_spec if engine_spec is not None else engine_shard_spec(m, il, rank_offset=W, include_mtp=False)
    pbytes, rbytes = DTYPE_BYTES[m.dtype.value], DTYPE_BYTES[cfg.rollout.dtype.value]

    def replicas(name: str) -> int:  # ranks sharing the AdamW state of this rank's buffer
        if zero3 and zero3_axis(name):
            return 1
        if name.endswith(_EXPERT_BUFFERS):
            return lay.plane // lay.expert_shards
        return lay.plane if grad_reduced_over_stage(name) else lay.dp

    def trainer_bytes(buffers) -> tuple[int, int]:
        params = sum(_numel(s) for _, s in buffers)
        stepped = [(name, _numel(s)) for name, s in buffers if not is_frozen(name, m)]
        opt = sum(-(-12 * n // replicas(name)) for name, n in stepped)
        return params * pbytes, (params + sum(n for _, n in stepped)) * pbytes + opt

    memo: dict[int, tuple[int, int]] = {}
    per_rank = [memo.get(id(rs.buffers)) or memo.setdefault(id(rs.buffers), trainer_bytes(rs.buffers))
                for rs in src.ranks]
    weights = tuple(sum(_numel(s) for _, s in rs.buffers) * rbytes for rs in dst.ranks)
    return RankBytes(trainer=tuple(b[1] for b in per_rank), reference=tuple(b[0] for b in per_rank),
                     rollout_weights=weights)


def memory_estimate(cfg: RunConfig, dm: DeviceMap, trainer_spec=None, engine_spec=None) -> dict[int, dict[str, int]]:
    """An estimate of the bytes each role rank keeps on its device, per device (see `memory_notes`).
    `trainer_spec` (ranks from 0) and `engine_spec` (ranks from W) are built when not given."""
    return device_bytes(cfg, dm, rank_bytes(cfg, trainer_spec, engine_spec))


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
    if p.device_type is DeviceType.cpu:
        kv = int(cfg.rollout.cpu_kv_cache_gib * GIB)
    else:
        kv = None  # vLLM takes gpu_memory_utilization of the device for weights + KV: sized below when known
    budget = int(cfg.rollout.gpu_memory_utilization * p.device_memory_gib * GIB)
    rollout = dm.devices_of("rollout")
    for rank, weights in enumerate(rb.rollout_weights):
        out[rollout[rank]]["rollout"] = weights + kv if kv is not None else max(weights, budget)
    reward = dm.devices_of("reward")
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
    notes.append(f"reward: {cfg.reward.kind.value}: " + ("the policy's shape, whole, per worker (an assumption)"
                                                       if cfg.reward.kind is RewardKind.model else "no device memory"))
    notes.append("co-located roles time-share a device: 'all' adds every resident role (nothing offloaded), "
                 "'peak' is the largest one (the others offloaded while it runs)")
    return notes
