"""`python -m benchmarks.reshard_bench`: one JSON line with the plan's numbers; --simulate plans only."""

import json
from pathlib import Path

import pytest

from benchmarks.reshard_bench import main, parse_layout
from rlhf.sharding.layout import InferenceLayout, Layout

TINY = str(Path(__file__).resolve().parents[3] / "configs" / "model" / "qwen3_moe_tiny.yaml")


def test_simulate_prints_one_json_line(capsys):
    assert main(["--simulate", "--topology", "single_node:4", "--model", TINY, "--src", "dp=2,ep=2",
                 "--dst", "tp=2,engines=1", "--dst-rank-offset", "2"]) == 0
    out = json.loads(capsys.readouterr().out.strip())
    assert out["bytes_network"] + out["bytes_local"] == out["bytes_minimal"] > 0
    assert out["simulated_seconds"] == out["floor_seconds"] > 0 and out["transfers"] > 0
    # the baseline: every engine rank receives the whole model (fp32) over a link of 10 GB/s
    from rlhf.config import load_model_config
    from rlhf.model.shapes import param_shapes
    import math
    model_bytes = 4 * sum(math.prod(s) for s in param_shapes(load_model_config(TINY)).values())
    assert out["baseline_seconds"] == pytest.approx(model_bytes / 10e9)
    # tp2 engine ranks each receive half the model: twice as fast as receiving all of it
    assert out["speedup_vs_baseline"] == pytest.approx(2.0, rel=0.05)
    assert out["src"] == "trainer dp2xep2" and out["dst"] == "engines 1x(tp2)" and out["plan_seconds"] >= 0


def test_layout_strings():
    assert parse_layout(Layout, "pp=12,dp=4,tp=8,ep=4,experts_over_tp_ep=1") == \
        Layout(pp=12, dp=4, tp=8, ep=4, experts_over_tp_ep=True)
    assert parse_layout(InferenceLayout, "tp=4,ep=8,engines=12") == InferenceLayout(tp=4, ep=8, engines=12)
    with pytest.raises(ValueError, match="key one of tp, ep, engines"):
        parse_layout(InferenceLayout, "dp=2")


def test_pure_layer_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys, weight_sync.plan, rlhf.sharding.engine, benchmarks.reshard_bench; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[3]).returncode == 0
