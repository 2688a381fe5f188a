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


def test_cpu_seconds_by_role_count_the_measured_steps_only(tmp_path):
    """`MemorySampler` with a steps file: each role's CPU seconds between the samples that first see the warm-up's
    and the run's last line; a process busy before the first mark and after the second is counted in between only."""
    import subprocess
    import sys
    import time

    from benchmarks.e2e_bench import MemorySampler, cpu_shares

    steps = tmp_path / "steps.jsonl"
    busy = "# TrainerWorker\nimport time\nt = time.process_time()\nwhile time.process_time() - t < 4: pass\n"
    with MemorySampler(period=0.05, steps_file=steps, warmup=1, total=2) as mem:
        child = subprocess.Popen([sys.executable, "-c", busy])
        try:
            time.sleep(0.8)
            steps.write_text("{}\n")  # the warm-up step
            time.sleep(1.0)
            steps.write_text("{}\n{}\n")  # the measured step
            time.sleep(0.3)
        finally:
            child.kill()
            child.wait()
    cpu = mem.cpu_seconds()
    assert 0.2 < cpu["trainer"] < 1.4, cpu  # about the second between the marks, not the 2 s it ran
    shares = cpu_shares(cpu, steps=1, seconds=1.0)
    assert shares["cpu_seconds_per_step"]["trainer"] == round(cpu["trainer"], 2)
    assert shares["cpu_seconds_per_step_total"] == round(sum(cpu.values()), 2)
    assert cpu_shares({}, 1, 1.0) == {}
