"""The gradient norm's sum of squares, block by block in fp64 on cpu, equals torch's fp64 norm."""

import pytest
import torch

import rlhf.parallel.trainer as trainer


@pytest.mark.parametrize("shape,block", [((3, 5), 4), ((300, 70), 1000), ((16, 33, 9), 7), ((5,), 1 << 16)])
def test_block_sums_of_squares_equal_torchs_fp64_norm(monkeypatch, shape, block):
    monkeypatch.setattr(trainer, "SQUARES_BLOCK", block)
    g = torch.Generator().manual_seed(0)
    t = torch.randn(shape, generator=g) * 1e3
    want = torch.linalg.vector_norm(t, dtype=torch.float64).square()
    got = trainer.squares_fp64(t)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert abs(got.item() - want.item()) <= 1e-12 * want.item()
    if t.dim() > 1:  # a transposed (non-contiguous) gradient: the same sum
        assert abs(trainer.squares_fp64(t.transpose(0, -1)).item() - want.item()) <= 1e-12 * want.item()
    assert trainer.squares_fp64(t.double()).item() == pytest.approx(want.item(), rel=1e-12)
    # a shard's squares plus the rest's: the whole tensor's, to fp64 rounding (the norm over shards)
    flat = t.reshape(-1)
    half = flat.numel() // 2
    assert (trainer.squares_fp64(flat[:half]) + trainer.squares_fp64(flat[half:])).item() == pytest.approx(
        want.item(), rel=1e-12)
