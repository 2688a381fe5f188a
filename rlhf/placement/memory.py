"""What a placement implies for memory: an estimate of the bytes each role rank keeps on its device, and
the assumptions behind it (`memory_notes`, printed by `rlhf plan`). Pure."""

from __future__ import annotations

from typing import Sequence

from rlhf.layout import inference_layout, trainer_layout
from rlhf.model.engine_sharding import engine_shard_spec
from rlhf.model.shapes import count_params
from rlhf.model.sharding import trainer_shard_spec, zero3_axis
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


def memory_estimate(cfg: RunConfig, dm: DeviceMap, trainer_spec=None, engine_spec=None) -> dict[int, dict[str, int]]:
    """An estimate of the bytes each role rank keeps on its device, per device (see `memory_notes`).
    `trainer_spec` (ranks from 0) and `engine_spec` (ranks from W) are built when not given."""

    m, p = cfg.model, cfg.placement
    zero3 = cfg.trainer.zero_stage == 3
    lay, il = trainer_layout(cfg.trainer), inference_layout(cfg.rollout)
    W = lay.world_size
    src = trainer_spec if trainer_spec is not None else trainer_shard_spec(m, lay, zero_stage=cfg.trainer.zero_stage)
    dst = engine_spec if engine_spec is not None else engine_shard_spec(m, il, rank_offset=W, include_mtp=False)
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
