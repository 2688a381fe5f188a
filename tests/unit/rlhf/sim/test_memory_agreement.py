"""The two memory accountings agree: `rlhf plan`'s shard-exact one (rlhf/placement/memory.py, walking the trainer's
and the engines' shard specs buffer by buffer) and the simulator's analytic one (rlhf/sim/memory.py, from the
`ModelCost` figures of a shape), on every shipped run config.

What is compared is what both count: a trainer rank's parameters, gradients and AdamW state; a reference rank's
parameters; an engine rank's weights before its KV cache. What only the simulator counts (activations, the logits
chunk, ZeRO-3's gathered layer, the KV cache sized from the hardware file, runtime) is not, by design.

Tolerance, and why it is what it is:
- trainer and reference: the plan rounds each buffer's AdamW slice up to a whole byte (ceil(12 n / replicas)); the
  simulator divides. So plan - sim lies in [0, one byte per buffer of the rank). Where the rows of a ZeRO-3 buffer
  split unevenly over its group the plan holds ceil(rows / n) and the simulator the mean; no case below does
  (every row dim divides), so the same bound holds for them.
- engines: both count whole elements, nothing is rounded; equal to float rounding (rel 1e-12).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.config import load_run_config
from rlhf.layout import inference_layout, trainer_layout
from rlhf.model.engine_sharding import engine_shard_spec
from rlhf.model.sharding import trainer_shard_spec
from rlhf.placement.memory import rank_bytes
from rlhf.sim.memory import engine_rank_params, reference_state_bytes, trainer_state_bytes
from rlhf.sim.report import candidate_of
from rlhf.sim.workload import model_cost, workload

ROOT = Path(__file__).resolve().parents[4]
RUN_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
# every shipped run config as it is, and ZeRO-3 on a tiny, a small and the 718B one
CASES = [(name, ()) for name in RUN_CONFIGS] + [
    (name, ("trainer.zero_stage=3",)) for name in ("tiny_cpu_pangu.yaml", "small_cpu.yaml", "cm384_pangu718b.yaml")]


def test_every_shipped_run_config_is_checked():
    assert {"tiny_cpu.yaml", "small_cpu.yaml", "tiny_cpu_disaggregated.yaml", "tiny_cpu_pangu.yaml",
            "cm384_pangu718b.yaml", "cm384_pangu718b_async.yaml", "h800_deepseek_v3.yaml"} <= set(RUN_CONFIGS)


@pytest.mark.parametrize("name, overrides", CASES, ids=[n + "".join(f"[{o}]" for o in ov) for n, ov in CASES])
def test_plan_and_simulator_count_the_same_state(name, overrides):
    cfg = load_run_config(ROOT / "configs" / name, list(overrides))
    lay = trainer_layout(cfg.trainer)
    src = trainer_shard_spec(cfg.model, lay, zero_stage=cfg.trainer.zero_stage)
    dst = engine_shard_spec(cfg.model, inference_layout(cfg.rollout), rank_offset=lay.world_size, include_mtp=False)
    plan = rank_bytes(cfg, src, dst)
    mc, w, c = model_cost(cfg.model), workload(cfg), candidate_of(cfg)
    nb = w.train_bytes

    # every trainer rank against its pipeline stage's figure, and the busiest device of each role
    for rank, got in enumerate(plan.trainer):
        stage = lay.coords(rank).pp
        sim = trainer_state_bytes(mc, c.trainer, nb, stage)
        assert 0 <= got - sim < len(src.ranks[rank].buffers), (rank, stage, got, sim)
    busiest = max(range(len(plan.trainer)), key=plan.trainer.__getitem__)
    assert 0 <= plan.trainer[busiest] - trainer_state_bytes(mc, c.trainer, nb) < len(src.ranks[busiest].buffers)
    # the reference: the trainer's shards, nothing rounded
    assert max(plan.reference) == pytest.approx(reference_state_bytes(mc, c.trainer, nb), rel=1e-12)

    weights = engine_rank_params(mc, c.engines) * w.rollout_bytes
    assert len(set(plan.rollout_weights)) == 1  # engine ranks hold equal shares (whole experts, even tp splits)
    assert plan.rollout_weights[0] == pytest.approx(weights, rel=1e-12)


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
