"""The Pangu Ultra MoE 718B sync on a CloudMatrix 384 plans within budget and its byte counts add up:
trainer pp12 x dp4 x tp8 (experts over tp x ep = 32 shards) on all 384 NPUs -> 12 engines of tp4 x ep8,
co-located on the first 96."""

import time
from pathlib import Path

from rlhf.config import load_model_config
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout
from weight_sync.plan import Topology, clear_plan_cache, plan_reshard
from rlhf.sharding.trainer import trainer_shard_spec

MODELS = Path(__file__).resolve().parents[3] / "configs" / "model"


def test_pangu_718b_plan_builds_and_counts_every_destination_byte():
    cfg = load_model_config(MODELS / "pangu_ultra_moe_718b.yaml")
    src = trainer_shard_spec(cfg, Layout(pp=12, dp=4, tp=8, ep=4, experts_over_tp_ep=True))
    dst = engine_shard_spec(cfg, InferenceLayout(tp=4, ep=8, engines=12))
    clear_plan_cache()
    t0 = time.process_time()  # CPU seconds: the test machine's cores are shared
    plan = plan_reshard(src, dst, Topology.cm384())
    seconds = time.process_time() - t0
    # a guard against a planner gone quadratic, not a benchmark (about 10 CPU s here, 11.6 on a busy machine)
    assert seconds < 30, f"718B plan took {seconds:.1f} CPU seconds"
    dst_bytes = 2 * sum(p.box.numel for r in dst.ranks for p in r.pieces)  # bfloat16
    assert plan.bytes_minimal == dst_bytes
    assert plan.bytes_network + plan.bytes_local == plan.bytes_minimal
    assert plan.bytes_local > 0  # engine ranks 0..95 are trainer ranks too
    # every engine holds the model once, plus its second attention-DP group's replica of the non-expert tensors
    assert 12 * 1.43e12 < plan.bytes_minimal < 12 * 1.6e12
    assert 0.4 < plan.floor_seconds(Topology.cm384()) < 0.6  # ~189 GB into each engine rank at 392 GB/s
