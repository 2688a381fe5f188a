"""The simulator looks for a trainer's busiest pipeline stage among a few candidates only (the search costs
thousands of layouts, pp up to the layer count): the first stage, the last and the first stage of each distinct
layer split. That is exact: every other stage holds the same layers as an earlier candidate (so the same state)
with fewer micro-batches in flight."""

from __future__ import annotations

from pathlib import Path

from rlhf.config import load_run_config
from rlhf.sim.candidate import TrainerChoice
from rlhf.sim.memory import _busiest_candidates, _split, trainer_stage_params, trainer_state_bytes
from rlhf.sim.workload import model_cost

CONFIGS = Path(__file__).resolve().parents[4] / "configs"


def test_every_stage_repeats_the_split_of_an_earlier_candidate():
    for layers in range(1, 70):
        for dense in range(0, min(layers, 5) + 1):
            for pp in range(1, layers + 1):
                split, cands = _split(layers, dense, pp), _busiest_candidates(layers, dense, pp)
                assert {0, pp - 1} <= set(cands)
                for s in range(pp):
                    assert any(c <= s and split[c] == split[s] for c in cands), (layers, dense, pp, s)


def test_the_busiest_stage_state_is_the_maximum_over_all_stages():
    m = load_run_config(CONFIGS / "cm384_pangu718b.yaml").model  # 61 layers, 3 dense, MTP on the last stage
    mc = model_cost(m)
    for pp in (1, 2, 4, 8, 12, 16, 61):
        for zero in (1, 3):
            t = TrainerChoice(pp=pp, dp=4, tp=8, ep=4, experts_over_tp_ep=True, zero_stage=zero)
            every = max(trainer_state_bytes(mc, t, 2, s) for s in range(pp))
            assert trainer_state_bytes(mc, t, 2) == every, (pp, zero)
            assert trainer_stage_params(mc, t, pp - 1)[1]["dp"] > 0  # the MTP modules: frozen, on the last stage
