"""benchmarks/stale_sync.py's comparison at equal wall-clock time, without running anything."""

import pytest

from benchmarks import stale_sync as bench


def test_equal_time_compares_each_evaluation_with_the_synchronous_runs_by_then():
    # (step, accuracy, seconds since the first evaluation); the synchronous run is slower per step
    sync = [{"accuracy": [(0, 0.25, 0.0), (5, 0.30, 10.0), (10, 0.32, 20.0)]},
            {"accuracy": [(0, 0.20, 0.0), (5, 0.28, 10.0), (10, 0.35, 20.0)]}]
    stale = [{"accuracy": [(0, 0.25, 0.0), (5, 0.27, 8.0), (10, 0.36, 16.0)]},
             {"accuracy": [(0, 0.20, 0.0), (5, 0.28, 8.0), (10, 0.30, 21.0)]}]
    assert bench.accuracy_at(sync[0]["accuracy"], 16.0) == 0.30  # its last evaluation by then
    r = bench.equal_time(sync, stale)
    # against 0.25, 0.30 (first seed) and 0.20, 0.35 (second): the first evaluations (the same policy) left out
    assert r["evaluations"] == 4 and (r["higher"], r["equal"], r["lower"]) == (3, 0, 1)
    assert r["mean_difference"] == pytest.approx((0.02 + 0.06 + 0.08 - 0.05) / 4, abs=1e-4)
    assert r["last_difference_runs"] == [pytest.approx(0.06), pytest.approx(-0.05)]
    assert r["last_difference_mean"] == pytest.approx(0.005)


def test_seeds_and_rounds_are_refused_together():
    with pytest.raises(SystemExit):
        bench.main(["--seeds", "0", "1", "--rounds", "2"])
    with pytest.raises(SystemExit):
        bench.main(["--seeds", "3", "3"])
