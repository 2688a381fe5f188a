"""benchmarks/decode_probe.py refuses bad arguments before it builds a policy or starts an engine."""

import pytest

from benchmarks.decode_probe import main


@pytest.mark.parametrize("argv, said", [(["--prompts", "0"], "--prompts 0: give 1 or more"),
                                        (["--new-tokens", "-1"], "--new-tokens -1: give 1 or more"),
                                        (["--core", "999"], "--core 999: this machine has cores 0-"),
                                        (["rollout.enforce_eagr=false"], "unknown key 'rollout.enforce_eagr'")])
def test_bad_arguments_are_refused_saying_what_to_give(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err
