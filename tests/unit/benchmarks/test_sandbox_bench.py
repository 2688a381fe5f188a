"""benchmarks/sandbox_bench.py's samples, and its argument checks (nothing run)."""

import json

import pytest

from benchmarks import sandbox_bench as bench


def test_samples_alternate_forms_and_count_the_runs_they_take():
    responses, answers, runs = bench.samples(8, cases=5)
    assert len(responses) == len(answers) == 8
    assert answers[0] == bench.ASSERT_TESTS and len(json.loads(answers[1])["inputs"]) == 5
    # four assert-style samples (one run each), two right stdio ones (5 runs), two wrong (stopped after the first)
    assert runs == 4 + 2 * 5 + 2 * 1


def test_bad_arguments_are_refused():
    for bad in (["--cases", "0"], ["--samples", "2"], ["--processes", "0"]):
        with pytest.raises(SystemExit):
            bench.main(bad)
