"""The shared-memory pieces that need no second process: declared pairs, segments on CPU (shared bytes, names
unlinked, foreign names refused), and same-device pairs from a device map."""

import os

import pytest
import torch

from weight_sync import shm



def ours() -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(shm.NAME_PREFIX)}


def test_pairs_are_symmetric_and_checked():
    assert shm.pair_set([(0, 2), (3, 1)]) == {(0, 2), (2, 0), (1, 3), (3, 1)}
    assert shm.pair_set(None) == frozenset()
    for bad, says in [((1, 1), "a rank with itself"), ((1,), "two plan ranks"), (("a", 2), "two plan ranks"),
                      ((-1, 2), "two plan ranks"), ([0, 1], "two plan ranks")]:
        with pytest.raises(ValueError, match=says):
            shm.pair_set([bad])


def test_segment_bytes_are_two_aligned_slots():
    assert shm.segment_bytes(1) == 2 * 4096
    assert shm.segment_bytes(4096) == 2 * 4096
    assert shm.segment_bytes(4097) == 2 * 8192


def test_cpu_segment_is_shared_and_leaves_no_name():
    before = ours()
    sender, kind, payload = shm.create_segment(shm.segment_bytes(1000), torch.device("cpu"))
    assert sender.path and os.path.exists(sender.path) and payload.decode().startswith(shm.NAME_PREFIX)
    receiver = shm.open_segment(sender.id, sender.nbytes, kind, payload)
    assert not os.path.exists(sender.path)  # unlinked once mapped on both sides
    sender.slot(1, 1000 * 4, torch.float32).copy_(torch.arange(1000, dtype=torch.float32))
    assert torch.equal(receiver.slot(1, 1000 * 4, torch.float32), torch.arange(1000, dtype=torch.float32))
    receiver.slot(0, 8, torch.int64).fill_(7)
    assert sender.data[:8].view(torch.int64).item() == 7  # both ways
    sender.unlink()  # idempotent
    assert sender.path is None and ours() <= before


def test_foreign_or_missing_segments_are_refused():
    with pytest.raises(ValueError, match="not a weight-sync shared-memory segment"):
        shm.open_segment(1, 8192, 1, b"../../etc/passwd")
    with pytest.raises(ValueError, match="not a weight-sync"):
        shm.open_segment(1, 8192, 1, b"psm_0123")
    with pytest.raises(FileNotFoundError):
        shm.open_segment(1, 8192, 1, (shm.NAME_PREFIX + "gone").encode())
    with pytest.raises(ValueError, match="no shared-memory path for meta buffers"):
        shm.create_segment(8192, torch.device("meta"))
