"""`all_reduce_bucketed` (rlhf/parallel/comm.py), the gradient all-reduce: over two gloo processes it sums
every tensor as one all-reduce per tensor would, whatever the bucket boundaries, views and odd sizes."""

import torch
import torch.distributed as dist

from rlhf.parallel.comm import all_reduce_bucketed
from rlhf.parallel.launch import run_ranks


def reduce_both_ways(rank, bucket_bytes):
    g = torch.Generator().manual_seed(rank)
    wide, big = torch.randn(64, 33, generator=g), torch.randn(300, 200, generator=g)
    tensors = [torch.randn(5, generator=g), wide[:, 1:7], torch.randn(3, 4, generator=g).t(),  # views, not contiguous
               torch.randn(1000, generator=g), torch.randn(2, 2, 2, generator=g), big]
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
    all_reduce_bucketed(tensors, dist.group.WORLD, bucket_bytes=bucket_bytes)
    return [t.tolist() for t in tensors], [t.tolist() for t in expected]


def test_bucketed_all_reduce_sums_like_one_all_reduce_per_tensor():
    for bucket_bytes in (1, 64, 4096, 1 << 20):  # every tensor alone, small buckets, mixed, all in one
        (got, expected), other = run_ranks(reduce_both_ways, 2, bucket_bytes)
        assert got == expected == other[0] == other[1]


def reduce_back_to_back(rank, bucket_bytes):
    """Tensors lying back to back in one buffer (the trainer's gradients on cpu) are summed in place, in
    buckets, with no concatenated copy."""
    g = torch.Generator().manual_seed(rank)
    buf = torch.randn(5 + 12 + 1000 + 8 + 60000, generator=g)
    shapes = [(5,), (3, 4), (1000,), (2, 2, 2), (300, 200)]
    tensors, at = [], 0
    for s in shapes:
        n = torch.Size(s).numel()
        tensors.append(buf[at:at + n].view(s))
        at += n
    expected = [t.clone() for t in tensors]
    for t in expected:
        dist.all_reduce(t)
    cats = []
    cat = torch.cat
    torch.cat = lambda *a, **k: cats.append(1) or cat(*a, **k)
    try:
        all_reduce_bucketed(tensors, dist.group.WORLD, bucket_bytes=bucket_bytes)
    finally:
        torch.cat = cat
    return [t.tolist() for t in tensors], [t.tolist() for t in expected], len(cats)


def test_back_to_back_tensors_are_reduced_in_place():
    for bucket_bytes in (1, 4096, 1 << 20):
        (got, expected, cats), other = run_ranks(reduce_back_to_back, 2, bucket_bytes)
        assert got == expected == other[0] == other[1] and cats == 0
