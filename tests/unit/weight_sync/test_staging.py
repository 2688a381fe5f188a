"""Staging buffers that give their memory back between syncs (weight_sync/staging.py)."""

import os

import torch

from weight_sync.staging import StagingBuffers


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_buffers_are_zeros_of_their_shapes_and_do_not_overlap():
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 2, 2)}
    bufs = StagingBuffers(shapes, torch.float32)
    assert {n: tuple(t.shape) for n, t in bufs.items()} == shapes
    assert all(t.dtype == torch.float32 and not t.any() for t in bufs.values())
    for i, t in enumerate(bufs.values()):
        t.fill_(i + 1)
    assert [set(t.unique().tolist()) for t in bufs.values()] == [{1.0}, {2.0}, {3.0}]
    assert all(t.data_ptr() % 64 == 0 for t in bufs.values())


def test_release_gives_memory_back_and_reads_as_zeros_in_the_same_tensors():
    n = 16 << 20  # 64 MiB of float32
    bufs = StagingBuffers({"w": (n,), "padding": (4, 1024)}, torch.float32)
    w, views = bufs["w"], bufs["w"][::1024]
    before = _rss()
    w.fill_(2.5)
    bufs["padding"].fill_(1.0)
    touched = _rss()
    assert touched - before > 60 << 20
    bufs.release()
    assert touched - _rss() > 60 << 20  # the pages went back
    assert bufs["w"] is w and not w.any() and not bufs["padding"].any()  # same tensors, zeros again
    w[:2048].copy_(torch.arange(2048, dtype=torch.float32))  # a view made before sees the next sync's writes
    assert views[:3].tolist() == [0.0, 1024.0, 0.0]


def test_bfloat16_and_empty():
    bufs = StagingBuffers({"x": (3, 3)}, torch.bfloat16)
    assert bufs["x"].dtype == torch.bfloat16 and not bufs["x"].any()
    empty = StagingBuffers({}, torch.float32)
    assert dict(empty) == {}
    empty.release()
