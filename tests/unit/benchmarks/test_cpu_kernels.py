"""benchmarks/cpu_kernels.py runs and ends with one JSON line holding each timing it names."""

import json

import pytest

from benchmarks.cpu_kernels import main


def test_sampling_part_prints_both_timings(capsys):
    main(["--only", "sampling", "--repeats", "1"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["gumbel_kernel_ms"] > 0 and out["inverse_cdf_ms"] > 0


def test_bad_repeats_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])
    assert "give at least 1" in capsys.readouterr().err
