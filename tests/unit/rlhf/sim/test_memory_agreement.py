"""The memory model (rlhf/sim/memory.py, from the `ModelCost` figures of a shape; `rlhf plan` and `rlhf simulate`
both count with it) against a count of what the shard specs hold, walking the trainer's and the engines' specs
buffer by buffer (`shard_walk` below: the specs the trainer and the weight sync allocate from), on every shipped
run config.

What is compared is what the walk can count: a trainer rank's parameters, gradients and AdamW state; a reference rank's
parameters; an engine rank's weights before its KV cache. What only the simulator counts (activations, the logits
chunk, ZeRO-3's gathered layer, the KV cache sized from the hardware file, runtime) is not, by design.

Tolerance, and why it is what it is:
- trainer and reference: the walk rounds each buffer's AdamW slice up to a whole byte (ceil(12 n / replicas)); the
  model divides. So walk - model lies in [0, one byte per buffer of the rank). Where the rows of a ZeRO-3 buffer
  split unevenly over its group the plan holds ceil(rows / n) and the simulator the mean; no case below does
  (every row dim divides), so the same bound holds for them.
- engines: both count whole elements, nothing is rounded; equal to float rounding (rel 1e-12).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.config import load_run_config
from rlhf.sharding.layout import inference_layout, trainer_layout
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.trainer import trainer_shard_spec
from rlhf.placement.device_memory import rank_bytes
from rlhf.report import candidate_of
from rlhf.sharding.trainer import grad_reduced_over_stage, is_frozen, zero3_axis
from rlhf.sim.memory import engine_rank_weight_bytes, reference_state_bytes, trainer_state_bytes
from rlhf.sim.workload import model_cost, workload
from weight_sync.plan import DTYPE_BYTES

ROOT = Path(__file__).resolve().parents[4]
RUN_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
# every shipped run config as it is, and ZeRO-3 on a tiny, a small and the 718B one
CASES = [(name, ()) for name in RUN_CONFIGS] + [
    (name, ("trainer.zero_stage=3",)) for name in ("tiny_cpu_pangu.yaml", "small_cpu.yaml", "cm384_pangu718b.yaml")] + [
    ("small_cpu.yaml", ("rollout.quantization=fp8_block",))]


_EXPERT_BUFFERS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_walk(cfg, src, dst) -> tuple[list[int], list[int], list[int]]:
    """(trainer, reference, engine weights) bytes per rank, from the specs: every buffer of a trainer rank, a
    gradient of each stepped one (not the frozen: the router's correction bias, the MTP modules), AdamW's fp32
    master and two moments of each stepped one split over the ranks holding identical copies, as
    `rlhf.parallel.optim` shards them (the DP group, the whole stage for what the stage's gradients are summed
    over, the expert replicas for routed experts; zero_stage=3 buffers are already this rank's rows)."""
    m, lay = cfg.model, trainer_layout(cfg.trainer)
    zero3 = cfg.trainer.zero_stage == 3
    pbytes, rbytes = DTYPE_BYTES[m.dtype.value], DTYPE_BYTES[cfg.rollout.dtype.value]

    def replicas(name: str) -> int:
        if zero3 and zero3_axis(name):
            return 1
        if name.endswith(_EXPERT_BUFFERS):
            return lay.plane // lay.expert_shards
        return lay.plane if grad_reduced_over_stage(name) else lay.dp

    trainer, reference = [], []
    for rs in src.ranks:
        params = sum(_numel(s) for _, s in rs.buffers)
        stepped = [(name, _numel(s)) for name, s in rs.buffers if not is_frozen(name, m)]
        opt = sum(-(-12 * n // replicas(name)) for name, n in stepped)
        reference.append(params * pbytes)
        trainer.append((params + sum(n for _, n in stepped)) * pbytes + opt)
    if cfg.rollout.quantization.value != "none":  # what fp8 engines hold: the wire form's bytes, scales included
        from weight_sync.wire import WireFormat, wire_spec

        wire = wire_spec(dst, WireFormat(cfg.rollout.quantization.value, dtype=cfg.rollout.dtype.value))
        return trainer, reference, [sum(_numel(s) for _, s in rs.buffers) for rs in wire.ranks]
    return trainer, reference, [sum(_numel(s) for _, s in rs.buffers) * rbytes for rs in dst.ranks]


def test_every_shipped_run_config_is_checked():
    assert {"tiny_cpu.yaml", "small_cpu.yaml", "tiny_cpu_disaggregated.yaml", "tiny_cpu_pangu.yaml",
            "cm384_pangu718b.yaml", "cm384_pangu718b_async.yaml", "h800_deepseek_v3.yaml"} <= set(RUN_CONFIGS)


@pytest.mark.parametrize("name, overrides", CASES, ids=[n + "".join(f"[{o}]" for o in ov) for n, ov in CASES])
def test_plan_and_simulator_count_the_same_state(name, overrides):
    fp8 = "quantization: fp8_block" in (ROOT / "configs" / name).read_text() or "rollout.quantization=fp8_block" in overrides
    if fp8 and not torch.cpu._is_amx_tile_supported():
        pytest.skip("an FP8-rollout config is refused on a cpu without AMX tiles (tests/unit/rlhf/config/test_load.py)")
    cfg = load_run_config(ROOT / "configs" / name, list(overrides))
    lay = trainer_layout(cfg.trainer)
    src = trainer_shard_spec(cfg.model, lay, zero_stage=cfg.trainer.zero_stage)
    dst = engine_shard_spec(cfg.model, inference_layout(cfg.rollout), rank_offset=lay.world_size, include_mtp=False)
    walk_trainer, walk_reference, walk_weights = shard_walk(cfg, src, dst)
    mc, w, c = model_cost(cfg.model), workload(cfg), candidate_of(cfg)
    nb = w.train_bytes

    # every trainer rank against its pipeline stage's figure, and the busiest device of each role
    for rank, got in enumerate(walk_trainer):
        stage = lay.coords(rank).pp
        sim = trainer_state_bytes(mc, c.trainer, nb, stage)
        assert 0 <= got - sim < len(src.ranks[rank].buffers), (rank, stage, got, sim)
    busiest = max(range(len(walk_trainer)), key=walk_trainer.__getitem__)
    assert 0 <= walk_trainer[busiest] - trainer_state_bytes(mc, c.trainer, nb) < len(src.ranks[busiest].buffers)
    # the reference: the trainer's shards, nothing rounded
    assert max(walk_reference) == pytest.approx(reference_state_bytes(mc, c.trainer, nb), rel=1e-12)
    for rank, got in enumerate(walk_reference):
        assert got == pytest.approx(reference_state_bytes(mc, c.trainer, nb, lay.coords(rank).pp), rel=1e-12)

    weights = engine_rank_weight_bytes(mc, c.engines, w.rollout_bytes, w.rollout_quant_bytes)
    assert len(set(walk_weights)) == 1  # engine ranks hold equal shares (whole experts, even tp splits)
    # exact, or for quantized engines within what the model leaves out: norms and routers are kept plain (2 bytes,
    # counted at the quantized rate) and partial blocks' scales
    assert walk_weights[0] == pytest.approx(weights, rel=2e-3 if w.rollout_quant_bytes else 1e-12)

    # what `rlhf plan` prints per rank is the model's, rounded up to a byte
    model = rank_bytes(cfg)
    assert len(model.trainer) == len(walk_trainer) and len(model.rollout_weights) == len(walk_weights)
    for rank, (walk, got) in enumerate(zip(walk_trainer, model.trainer)):
        assert 0 <= walk - got < len(src.ranks[rank].buffers), (rank, walk, got)
    for walk, got in zip(walk_reference, model.reference):
        assert abs(walk - got) <= 1, (walk, got)
    for walk, got in zip(walk_weights, model.rollout_weights):
        assert abs(walk - got) <= (2e-3 * walk if w.rollout_quant_bytes else 1), (walk, got)


def test_the_agreement_is_not_vacuous():
    """The 718B run has what tells the accountings apart: stages of unequal layer counts (61 over pp=12), the
    embedding on the first and the LM head and an MTP module on the last, tp=8 beside whole-per-rank tensors (the
    trainer's head, norms, routers, MLA latents), a vocabulary padded for the engines. A side that ignored one
    of these would miss the other by more than the tolerance (checked by hand when this test was written: drop
    the final norm from the engine's count, or split the router's AdamW state over dp alone, and it fails)."""
    cfg = load_run_config(ROOT / "configs" / "cm384_pangu718b.yaml")
    mc, c = model_cost(cfg.model), candidate_of(cfg)
    stages = [trainer_state_bytes(mc, c.trainer, 2, s) for s in range(c.trainer.pp)]
    assert len(set(stages)) > 2 and max(stages) > sum(stages) / len(stages) and mc.mtp_layers == 1
    assert c.trainer.tp == 8 and mc.moe_layer.stage > 0 and mc.vocab % 64
