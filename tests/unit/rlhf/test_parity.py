import pytest
import torch

from rlhf.parity import logprob_parity


def test_parity_masks_and_reports():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    b = torch.tensor([[-1.0, -2.5, -9.0], [-0.25, -0.5, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    p = logprob_parity(a, b, m)
    assert (p.max_abs_diff, p.tokens) == (0.5, 4) and p.mean_abs_diff == pytest.approx(0.1875)
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_parity(a, b[:, :2], m)
