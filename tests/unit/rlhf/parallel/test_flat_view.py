"""The optimizer's gradient slice as a view where the gradients lie back to back (rlhf/parallel/comm.py: the optimizer and the gradient all-reduce)."""

import torch

from rlhf.parallel.comm import flat_view


def test_back_to_back_tensors_give_a_view_of_any_range():
    buf = torch.arange(20, dtype=torch.float32)
    parts = [buf[0:6].view(2, 3), buf[6:10], buf[10:20].view(5, 2)]
    v = flat_view(parts, 4, 13)
    assert torch.equal(v, torch.cat([p.reshape(-1) for p in parts])[4:13])
    v.fill_(-1)  # a view: writes land in the tensors
    assert buf[4:13].eq(-1).all() and buf[13] == 13


def test_a_gap_another_order_or_a_strided_tensor_gives_none():
    buf = torch.arange(20, dtype=torch.float32)
    assert flat_view([buf[0:6], buf[7:10]], 0, 9) is None  # a gap
    assert flat_view([buf[6:10], buf[0:6]], 0, 10) is None  # not in memory order
    assert flat_view([buf.view(4, 5).t()], 0, 20) is None  # not contiguous
    assert flat_view([buf[0:6], torch.zeros(4)], 0, 10) is None  # another storage
    assert flat_view([], 0, 0) is None
