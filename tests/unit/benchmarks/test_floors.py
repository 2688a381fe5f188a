"""The e2e benchmark's floors (benchmarks/floors.py): the update's matmul FLOPs and the weight bytes a decode step
reads, from the model's shape, and the phases over them."""

import pytest
import torch

from benchmarks.floors import decode_bytes, machine_rates, phase_floors, update_flops
from rlhf.config import load_run_config
from rlhf.schema import ModelConfig

SMALL = ModelConfig(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                    moe_intermediate_size=256)


def test_update_flops_count_the_active_matmuls_three_times():
    """6 x active parameters per token (forward 2, backward 4): the small model's 35.4 M active parameters
    (attention 6.3 M, 4 of 32 experts 12.6 M, routers, the head 16.4 M; not the embedding), plus attention."""
    attention = 8 * (2 * 512 * 512 + 2 * 512 * 256)
    experts = 8 * 4 * 3 * 512 * 256
    norms = 8 * (2 * 512 + 2 * 64)  # counted with the layers' parameters (a rounding error in the FLOPs)
    active = attention + experts + norms + 8 * 32 * 512 + 32000 * 512
    tokens, samples = 8704, 64
    context = tokens / samples / 2
    want = 6 * tokens * (active + 8 * 2 * 8 * 64 * context)
    assert update_flops(SMALL, tokens, samples) == want
    assert update_flops(SMALL, tokens, samples, epochs=2) == 2 * want


def test_decode_reads_every_weight_but_the_embedding():
    total = sum(p.numel() for p in _model_shapes(SMALL))
    embed = 32000 * 512
    assert decode_bytes(SMALL, torch.bfloat16) == 2 * (total - embed)
    assert decode_bytes(SMALL, torch.float32, tp=2) == 2 * (total - embed)
    head = 32000 * 512  # fp8 engines read 8-bit weights (a 4-byte scale a 128 x 128 block) but the bf16 head
    assert decode_bytes(SMALL, torch.bfloat16, quant_bytes=1 + 4 / 128 ** 2) == pytest.approx(
        (total - embed - head) * (1 + 4 / 128 ** 2) + 2 * head)


def _model_shapes(cfg):
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    with torch.device("meta"):
        return list(Qwen3MoeForCausalLM(cfg).parameters())


def test_phase_floors_of_the_small_config():
    cfg = load_run_config("configs/small_cpu.yaml")
    rates = {"matmul_tflops": 1.0, "memory_gb_per_s": 10.0}
    f = phase_floors(cfg, rates, update_s=20.0, generate_s=8.0, trained_tokens=8704, decode_steps=128)
    flops = update_flops(cfg.model, 8704, 64)
    assert f["update_flops"] == flops
    assert f["update_floor_seconds"] == round(flops / 2e12, 3)  # two trainer ranks of a thread each
    assert f["update_over_floor"] == round(20.0 / (flops / 2e12), 2)
    assert f["generate_floor_seconds"] == round(128 * decode_bytes(cfg.model, torch.bfloat16) / 1e10, 3)


def test_machine_rates_are_measured_and_leave_the_threads_as_they_were():
    before = torch.get_num_threads()
    rates = machine_rates(torch.float32, tries=1)
    assert rates["matmul_tflops"] > 0.001 and rates["memory_gb_per_s"] > 0.1
    assert torch.get_num_threads() == before
