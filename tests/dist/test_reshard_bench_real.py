"""`python -m benchmarks.reshard_bench` without --simulate runs the plan over real gloo processes."""

import json
from pathlib import Path

from benchmarks.reshard_bench import main

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "model" / "qwen3_moe_tiny.yaml")


def test_real_run_prints_exact_sync_floor_and_baseline(capsys):
    assert main(["--model", TINY, "--src", "tp=2", "--dst", "tp=1,ep=2", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["exact"] is True and out["processes"] == 2
    assert out["bytes_network"] + out["bytes_local"] == out["bytes_minimal"] > 0
    for key in ("seconds", "seconds_no_checksum", "floor_seconds", "baseline_seconds"):
        assert out[key] > 0
