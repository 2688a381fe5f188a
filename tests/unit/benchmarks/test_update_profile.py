"""benchmarks/update_profile.py: bad arguments are refused before any rank starts, saying what to give."""

import pytest

from benchmarks.update_profile import main


@pytest.mark.parametrize("argv,says", [
    (["--memory-categories", "--ranks", "2"], "--ranks 1"),
    (["--micro-batch-tokens", "0"], "positive token count"),
    (["--expert-rows-multiple", "0"], "give 1 (no padding) or more"),
])
def test_bad_arguments_are_refused_with_what_to_give(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_matmul_shapes_counts_each_op_and_shape_once():
    """`matmul_shapes`: what oneDNN builds a primitive for, one per matmul op and operand shapes."""
    import torch

    from benchmarks.update_profile import matmul_shapes

    a, b, c = torch.randn(8, 4), torch.randn(4, 6), torch.randn(3, 8, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        a @ b, a @ b, a[:5] @ b, torch.bmm(c, b.expand(3, 4, 6)), a.sum()
    assert matmul_shapes(prof) == 3
