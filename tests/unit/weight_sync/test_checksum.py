"""The sync's block checksum and bucket policy, in-process: every single flipped bit of a bucket changes
the checksum entry of exactly the block that holds it, whatever the size, dtype or alignment; large
transfers travel alone, the rest are packed in plan order up to the bucket size."""

import pytest
import torch

from weight_sync.p2p import _block_bytes, _buckets, all_finite, bucket_checksum
from weight_sync.plan import Transfer
from weight_sync.spec import Box


@pytest.mark.parametrize("dtype,numel", [(torch.float32, 2048), (torch.float32, 3001), (torch.bfloat16, 4099),
                                         (torch.bfloat16, 7)])
def test_every_single_bit_flip_is_caught_in_its_block(dtype, numel):
    x = torch.randn(numel + 1, generator=torch.Generator().manual_seed(numel)).to(dtype)[1:]  # unaligned view
    want = bucket_checksum(x)
    assert torch.equal(want, bucket_checksum(x.clone()))  # alignment does not change it
    nbytes = numel * x.element_size()
    raw = x.clone().view(torch.uint8)
    step = max(1, nbytes // 97)  # bytes spread over the whole bucket, all 8 bits of each, and the last byte
    for byte in [*range(0, nbytes, step), nbytes - 1]:
        for bit in range(8):
            raw[byte] ^= 1 << bit
            got = bucket_checksum(raw.view(dtype))
            raw[byte] ^= 1 << bit
            bad = (got != want).nonzero().flatten().tolist()
            assert len(bad) == 1, (byte, bit, bad)
            lo, hi = _block_bytes(bad[0], nbytes)
            assert lo <= byte < hi, (byte, bit, lo, hi)


def transfer(n: int) -> Transfer:
    return Transfer("w", Box((0,), (n,)), 0, "a", (0,), 1, "b", (0,), False)


def test_large_transfers_travel_alone_the_rest_fill_buckets_in_order():
    sizes = [10, 10, 300, 10, 10, 10, 1000, 5]  # elements of 4 bytes
    buckets = _buckets(tuple(transfer(n) for n in sizes), 4, bucket_bytes=100, alone_bytes=1024)
    assert [[t.numel for t in b] for b in buckets] == [[10, 10], [300], [10, 10], [10], [1000], [5]]
    # without alone_bytes a transfer larger than a bucket is still a bucket of its own, never split
    assert [[t.numel for t in b] for b in _buckets(tuple(transfer(n) for n in sizes), 4, 100)] == \
        [[10, 10], [300], [10, 10], [10], [1000], [5]]
    assert [[t.numel for t in b] for b in _buckets(tuple(transfer(n) for n in sizes), 4, 1 << 20, 1024)] == \
        [[10, 10], [300], [10, 10, 10], [1000], [5]]
    assert _buckets((), 4, 100) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_check_catches_every_nan_and_inf_and_no_finite_overflow(dtype):
    """The received-bucket check (`all_finite`: a sum first, the elementwise check when the sum is not finite)
    agrees with `isfinite(...).all()` everywhere: one NaN, +inf or -inf anywhere, +inf beside -inf, and finite
    values whose sum overflows (finite, so accepted)."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in (0, 2500, 4999):
            y = x.clone()
            y[i] = bad
            assert not all_finite(y)
    y = x.clone()
    y[1], y[2] = float("inf"), -float("inf")
    assert not all_finite(y)
    big = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)
    assert not torch.isfinite(big.sum()) and all_finite(big)


def test_the_receiver_posts_room_for_exactly_the_sums_a_bucket_gets():
    """A receiver posts its senders' block-sum receive before any bucket arrives (`_post_sums`), sized from the
    plan by `_n_sums`: it must equal what `bucket_checksum` gives, aligned or not, a whole number of blocks or not."""
    from weight_sync.p2p import _n_sums, bucket_checksum

    for nbytes in (8, 4096, 4100, 8192, 12288 + 24, 65536 + 4095):
        data = torch.zeros(nbytes + 8, dtype=torch.uint8)
        for start in (0, 4):  # a bucket that is a view into a larger buffer need not be 8-byte aligned
            assert bucket_checksum(data[start:start + nbytes]).numel() == _n_sums(nbytes), (nbytes, start)
