"""The end-to-end benchmark's step figures (benchmarks/e2e_bench.py): the run's final held-out evaluation,
which ends its last step, is not counted as step time."""

import pytest

from benchmarks.e2e_bench import measured


def test_evaluation_is_left_out_of_step_seconds_and_tokens_per_second():
    steps = [{"time/step": 10.0, "time/update": 6.0, "rollout/generated_tokens": 800},
             {"time/step": 15.0, "time/update": 7.0, "time/evaluate": 4.0, "rollout/generated_tokens": 1000}]
    seconds, tokens, phases = measured(steps)
    assert seconds == pytest.approx(21.0)  # 10 + (15 - 4)
    assert tokens == 1800
    assert phases == pytest.approx({"step": 12.5, "update": 6.5, "evaluate": 2.0})


def test_the_hidden_share_of_generation_is_printed_under_stalesync_only():
    from benchmarks.e2e_bench import hidden_share

    assert hidden_share({"generate": 3.0, "update": 7.0}) == {}  # synchronous: no wait_for_rollouts
    assert hidden_share({"generate": 5.0, "wait_for_rollouts": 0.5}) == {"generate_hidden_share": 0.9}
    assert hidden_share({"generate": 2.0, "wait_for_rollouts": 3.0}) == {"generate_hidden_share": 0.0}
