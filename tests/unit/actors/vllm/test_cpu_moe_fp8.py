"""The FP8 form of the tiled MoE kernel (`rlhf_cpu::decode_moe_fp8`, actors/vllm/csrc/decode_moe.cpp): block-FP8
experts (float8_e4m3fn in 128 x 128 blocks, one fp32 scale each: what `rollout.quantization=fp8_block` engines hold)
computed as W8A16. Every fp8 byte becomes its exact value; the layer equals a torch reference over the dequantized
weights that rounds where a bf16 layer does, with AMX tiles and with AVX-512 alone, for the routing shapes an
engine meets (one row, more rows than an AMX tile holds, empty experts, other expert-parallel ranks' zero-weight
slots); a token's output does not depend on its batch or the threads; bad input is refused."""

import pytest
import torch

from rlhf.config.validate import tiled_moe_missing
from tests.unit.actors.vllm.test_cpu_moe import _reference as bf16_reference
from tests.unit.actors.vllm.test_cpu_moe import _routes

WHY = tiled_moe_missing()
needs_kernel = pytest.mark.skipif(WHY is not None, reason=f"the tiled kernel cannot run here: {WHY}")
AMX = bool(torch.cpu._is_amx_tile_supported())
FORMS = [False, pytest.param(True, marks=pytest.mark.skipif(not AMX, reason="this cpu has no AMX tiles (amx_bf16)"))]


def _ops():
    from actors.vllm import cpu_moe

    cpu_moe.load()
    return torch.ops.rlhf_cpu


def _layer(E=6, H=256, I=128, seed=0):
    from weight_sync.quant import quantize_fp8_block

    g = torch.Generator().manual_seed(seed)
    q13, s13 = quantize_fp8_block(torch.randn(E, 2 * I, H, generator=g) * 0.05)
    q2, s2 = quantize_fp8_block(torch.randn(E, H, I, generator=g) * 0.05)
    return q13, s13, q2, s2


def _packed(ops, q13, s13, q2, s2):
    return ops.decode_moe_pack(q13), s13, ops.decode_moe_pack(q2), s2


def _dequantized(q, s):
    return q.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)


def _reference(x, ids, weights, q13, s13, q2, s2):
    """The bf16 form's reference (fp32 products, rounded to bf16 where a bf16 layer rounds) over the dequantized
    weights."""
    return bf16_reference(x, ids, weights, _dequantized(q13, s13), _dequantized(q2, s2))


@needs_kernel
@pytest.mark.parametrize("amx", FORMS)
def test_every_fp8_byte_becomes_its_value(amx):
    # gate 20 (silu rounds it to 20 in bf16), up = the 254 finite byte values, w2 the identity, scales 1: each
    # output is 20 x a byte's value, exact in bf16, so any byte converted wrongly shows
    ops, H = _ops(), 128
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = torch.where(values.isnan(), 0.0, values)
    w13 = torch.zeros(1, 2 * H, H)
    w13[0, :H, :2] = 20.0
    w13[0, H:, 0], w13[0, H:, 1] = values[:128], values[128:]
    q13, q2 = w13.to(torch.float8_e4m3fn), torch.eye(H)[None].to(torch.float8_e4m3fn)
    x, ids, weights = torch.eye(2, H).bfloat16(), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    out = ops.decode_moe_fp8(x, ids, weights, *_packed(ops, q13, torch.ones(1, 2, 1), q2, torch.ones(1, 1, 1)),
                             amx=amx)
    assert torch.equal(out.float().flatten() / 20, values)


@needs_kernel
@pytest.mark.parametrize("amx", FORMS)
@pytest.mark.parametrize("T,counts", [
    (1, None),  # one token: one row an expert
    (6, [3, 4, 5, 0, 0, 0]),  # few rows, empty experts
    (16, [20, 0, 17, 1, 16, 10]),  # more rows than an AMX tile's 16, and exactly 16
    (48, None),  # a prefill's many rows an expert
])
def test_fp8_kernel_equals_a_reference_over_the_dequantized_weights(amx, T, counts):
    ops, layer = _ops(), _layer()
    x = (torch.randn(T, 256, generator=torch.Generator().manual_seed(T)) * 0.5).bfloat16()
    ids, weights = _routes(T, 6, 4 if counts is None else sum(counts) // T, T, counts)
    got = ops.decode_moe_fp8(x, ids, weights, *_packed(ops, *layer), amx=amx)
    want = _reference(x, ids, weights, *layer)
    # another order of sums than torch's: an intermediate rounding to bf16 may go the other way (as the bf16 form)
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= scale * 2 ** -7
    assert (got == want).float().mean() > 0.9


@needs_kernel
@pytest.mark.parametrize("amx", FORMS)
def test_zero_weight_slots_are_skipped_and_a_nan_reaches_only_its_tokens(amx):
    ops, (q13, s13, q2, s2) = _ops(), _layer()
    x = (torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * 0.5).bfloat16()
    ids, weights = _routes(5, 6, 4, 1)
    foreign = ids >= 3  # another expert-parallel rank's experts: id 0, weight 0 (actors/vllm/worker_ext.py)
    local_ids, local_w = torch.where(foreign, 0, ids).int(), torch.where(foreign, 0.0, weights)
    got = ops.decode_moe_fp8(x, local_ids, local_w, *_packed(ops, q13, s13, q2, s2), amx=amx)
    want = _reference(x, ids, local_w, q13, s13, q2, s2)
    assert (got.float() - want.float()).abs().max() <= want.float().abs().max() * 2 ** -7
    nan = q13.clone()
    nan[0, 3, 5] = float("nan")
    got_nan = ops.decode_moe_fp8(x, local_ids, local_w, *_packed(ops, nan, s13, q2, s2), amx=amx)
    uses0 = ((local_ids == 0) & (local_w != 0)).any(-1)
    assert got_nan[uses0].float().isnan().all(-1).all() and torch.equal(got_nan[~uses0], got[~uses0])


@needs_kernel
@pytest.mark.parametrize("amx", FORMS)
def test_a_tokens_output_depends_neither_on_its_batch_nor_the_threads(amx):
    ops, layer = _ops(), _layer()
    x = (torch.randn(40, 256, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16()
    ids, weights = _routes(40, 6, 4, 3)  # about 27 rows an expert: two AMX row tiles
    packed = _packed(ops, *layer)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = ops.decode_moe_fp8(x, ids, weights, *packed, amx=amx)
        torch.set_num_threads(2)
        two = ops.decode_moe_fp8(x, ids, weights, *packed, amx=amx)
    finally:
        torch.set_num_threads(threads)
    alone = torch.cat([ops.decode_moe_fp8(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], *packed, amx=amx)
                       for t in range(40)])
    assert torch.equal(together, two) and torch.equal(together, alone)


@needs_kernel
def test_bad_input_is_refused_with_what_is_wrong():
    ops, (q13, s13, q2, s2) = _ops(), _layer()
    packed = _packed(ops, q13, s13, q2, s2)
    x, ids, weights = torch.zeros(2, 256, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match=r"fp32 scales \[E, 2I / 128, H / 128\]"):
        ops.decode_moe_fp8(x, ids, weights, packed[0], s13[:, :1].contiguous(), *packed[2:])
    with pytest.raises(RuntimeError, match=r"x \[T, H\], packed w13 \[E, 2I, H\]"):
        ops.decode_moe_fp8(x[0], ids, weights, *packed)
    with pytest.raises(RuntimeError, match="float8_e4m3fn contiguous weights"):
        ops.decode_moe_fp8(x, ids, weights, packed[0].float(), *packed[1:])
    with pytest.raises(RuntimeError, match="H and I multiples of 128"):
        ops.decode_moe_fp8(x, ids, weights, *_packed(ops, *_layer(I=64)[:2], *_layer(I=64)[2:]))
