"""`rollout.quantization` is refused before anything starts where it cannot run, naming what to change."""

import pytest
import torch

from rlhf.config import load_run_config
from rlhf.errors import ConfigError

AMX = bool(torch.cpu._is_amx_tile_supported())


def test_fp8_needs_bf16_engines():
    with pytest.raises(ConfigError, match=r"rollout.dtype = 'float32': rollout.quantization=fp8_block runs bf16"):
        load_run_config("configs/tiny_cpu.yaml", ["rollout.quantization=fp8_block"])


def test_int8_is_refused_as_not_built():
    with pytest.raises(ConfigError, match=r"rollout.quantization = 'int8_channel': is not built yet"):
        load_run_config("configs/tiny_cpu.yaml", ["rollout.quantization=int8_channel"])


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
def test_a_cpu_without_amx_is_refused():
    with pytest.raises(ConfigError, match=r"this cpu has no AMX tiles .* use rollout.quantization=none here"):
        load_run_config("configs/small_cpu.yaml", ["rollout.quantization=fp8_block"])
