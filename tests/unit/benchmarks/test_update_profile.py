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
