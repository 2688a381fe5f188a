"""What a phase of the RL step would take at this machine's own rates: the floors the e2e benchmark prints its
phases against.

- The update's floor: its matmul FLOPs (forward and backward, `rlhf.sim.workload.ModelCost.forward_flops` x 3 per
  epoch over the trained tokens) at the rate a plain matmul of the trainer's compute dtype reaches here, on the
  trainer's threads (each rank its own, the ranks side by side).
- Generation's floor: every weight an engine holds but the embedding read once per decode step (with tens of
  sequences a step, top-k routing touches nearly every expert), at the rate one thread reads memory here; engines
  decode side by side, so the floor is one engine's.

Both rates are measured in this process, before the run and with nothing else running (`machine_rates`).
"""

from __future__ import annotations

import torch

from rlhf.driver.calibrate import matmul_tflops, memory_gbytes_per_s
from rlhf.schema import ModelConfig
from rlhf.sim.workload import model_cost, quant_bytes


def machine_rates(dtype: torch.dtype, threads: int = 1, tries: int = 3) -> dict[str, float]:
    """This machine's matmul rate in `dtype` and its memory bandwidth on `threads` threads (`rlhf calibrate`'s
    probes: the median over model-like matmul shapes; a copy's bytes read and written), the best of `tries`: a
    floor is what the machine can do, and a probe reads low while other processes still hold the cores."""
    before = torch.get_num_threads()
    try:
        return {"matmul_tflops": max(matmul_tflops(dtype, threads) for _ in range(tries)),
                "memory_gb_per_s": memory_rate(threads, tries)}
    finally:
        torch.set_num_threads(before)


def memory_rate(threads: int = 1, tries: int = 3) -> float:
    """This machine's memory bandwidth on `threads` threads, GB/s: the best of `tries` copies, the caller's thread
    count left as it was."""
    before = torch.get_num_threads()
    try:
        return max(memory_gbytes_per_s(threads) for _ in range(tries))
    finally:
        torch.set_num_threads(before)


def update_flops(model: ModelConfig, tokens: float, samples: int, epochs: int = 1) -> float:
    """Matmul FLOPs of one policy update over `tokens` tokens in `samples` sequences: forward and backward (2x the
    forward) per epoch; each token attends to half its sequence on average (causal)."""
    context = tokens / max(samples, 1) / 2
    return 3.0 * epochs * model_cost(model).forward_flops(tokens, context)


def decode_bytes(model: ModelConfig, dtype: torch.dtype, tp: int = 1, quant_bytes: float = 0.0) -> float:
    """Weight bytes one engine rank reads per decode step: every parameter but the embedding (a lookup of a few
    rows), split over its tp ranks; with `quant_bytes` (quantized engines, `rlhf.sim.workload.quant_bytes`) all but
    the LM head at that many bytes an element."""
    c = model_cost(model)
    size = torch.empty((), dtype=dtype).element_size()
    if quant_bytes:
        return ((c.total + c.final_norm - c.embed - c.head) * quant_bytes + c.head * size) / tp
    return (c.total + c.final_norm - c.embed) * size / tp


def engine_decode_bytes(cfg) -> float:
    """`decode_bytes` of one engine rank of run config `cfg`: its dtype, tp and weight format."""
    r = cfg.rollout
    return decode_bytes(cfg.model, getattr(torch, (r.dtype or cfg.model.dtype).value), r.tp,
                        quant_bytes(r.quantization.value, cfg.model.hidden_size))


def phase_floors(cfg, rates: dict[str, float], update_s: float, generate_s: float, trained_tokens: float,
                 decode_steps: float) -> dict[str, float]:
    """The benchmark's floor fields for one step of run config `cfg`: the update's and generation's floor seconds
    at `rates` (`machine_rates` in the trainer's compute dtype), and each measured phase over its floor.
    `trained_tokens`: tokens the update trains on (all DP ranks); `decode_steps`: the longest completion's tokens."""
    t = cfg.trainer
    samples = cfg.data.prompts_per_step * cfg.algorithm.group_size
    ranks = t.dp * t.tp * t.pp  # each its own thread, side by side; TP and PP ranks share a sequence's FLOPs
    flops = update_flops(cfg.model, trained_tokens, samples, t.epochs)
    update_floor = flops / (ranks * rates["matmul_tflops"] * 1e12)
    generate_floor = decode_steps * engine_decode_bytes(cfg) / (rates["memory_gb_per_s"] * 1e9)
    return {"update_flops": flops, "update_floor_seconds": round(update_floor, 3),
            "update_over_floor": round(update_s / update_floor, 2),
            "generate_floor_seconds": round(generate_floor, 3),
            "generate_over_floor": round(generate_s / generate_floor, 2)}
