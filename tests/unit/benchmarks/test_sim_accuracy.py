"""benchmarks/sim_accuracy.py without running anything: every run it measures is a valid config, the set
has calibration and held-out runs of both models, and a run's measured phases map onto the simulator's."""

import pytest

from benchmarks import sim_accuracy as sa


def test_at_least_eight_runs_split_into_calibration_and_held_out():
    assert len(sa.RUNS) >= 8 and len({r.name for r in sa.RUNS}) == len(sa.RUNS)
    for held in (False, True):
        group = [r for r in sa.RUNS if r.heldout is held]
        assert any(r.config.endswith("small_cpu.yaml") for r in group)
        assert any(r.config.startswith("configs/tiny_cpu") for r in group)


@pytest.mark.parametrize("run", sa.RUNS, ids=lambda r: r.name)
def test_every_run_is_a_valid_config(run):
    cfg = sa.load(run)  # raises ConfigError naming the bad override
    assert cfg.steps >= 1


def test_measured_phases_map_onto_the_simulators():
    m = {"phase_seconds": {"rollout": 0.5, "reward": 0.01, "generate": 0.48, "old_logprobs": 0.3, "update": 0.9,
                           "weight_sync": 0.1, "switch_to_training": 0.01, "switch_to_rollout": 0.01,
                           "evaluate": 0.2, "checkpoint": 0.05, "step": 2.15}}
    ph = sa.measured_phases(m)
    assert ph["generate"] == pytest.approx(0.49) and ph["logprobs"] == 0.3 and ph["offload"] == pytest.approx(0.02)
    assert ph["step"] == pytest.approx(1.9)  # without the last step's evaluation and checkpoint
    assert ph["driver"] == pytest.approx(1.9 - 0.49 - 0.01 - 0.3 - 0.9 - 0.1 - 0.02)


def test_repeats_give_each_phase_its_median():
    reps = [{"generated_tokens_per_step": 96.0, "prompt_tokens": 9.5,
             "phase_seconds": {"update": u, "step": s, **extra}}
            for u, s, extra in ((0.9, 2.0, {}), (0.5, 1.2, {"checkpoint": 0.1}), (0.7, 3.0, {}))]
    m = sa.median_of(reps)
    assert m["phase_seconds"] == {"update": 0.7, "step": 2.0, "checkpoint": 0.0}  # a phase missing counts 0
    assert m["repeats"] == 3 and m["generated_tokens_per_step"] == 96.0 and m["prompt_tokens"] == 9.5
    assert reps[0]["phase_seconds"]["update"] == 0.9  # the repeats themselves untouched
