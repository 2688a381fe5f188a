"""The code task with feedback (`rlhf.agents.code:CodeFeedback`): a program run in the code verifier's sandbox,
a failing one answered with the verdict filled into the feedback template and tried again, a passing one
rewarded by its try; bad arguments refused before any actor starts."""

import json

import pytest

from rlhf.agents.environment import load_environment
from rlhf.agents.episode import Limits, Status
from rlhf.agents.runner import run_episodes
from rlhf.data.prompts import PromptRow
from rlhf.data.tokenizer import ALPHABET, build_tokenizer
from rlhf.errors import ConfigError

SANDBOX = {"timeout_s": 5.0, "memory_mb": 256, "processes": 1}
TOK = build_tokenizer(32, ALPHABET + "print()")


def _row(answer: str) -> PromptRow:
    return PromptRow("1+2=", json.dumps({"inputs": [""], "outputs": [answer]}), "t:0")


def test_a_failing_program_is_told_what_it_printed_and_a_later_pass_is_rewarded_by_its_try():
    make = load_environment("rlhf.agents.code:CodeFeedback", {"decay": 0.5, "sandbox": SANDBOX})
    env = make()
    env.reset(_row("3"))
    first = env.step("print(4)")
    assert (first.text, first.done) == ("=4?", False)  # the default template, in the tiny world's alphabet
    assert env.step("print(3").text == "=?"  # a syntax error prints nothing
    last = env.step("print(3)")
    assert last.done and last.reward == 0.25  # the third try


def test_the_template_takes_the_verdict_and_the_detail():
    env = load_environment("rlhf.agents.code:CodeFeedback",
                           {"feedback": "{status}: {detail}", "sandbox": SANDBOX})()
    env.reset(_row("3"))
    assert env.step("print(5)").text == "failed: case 0: expected '3', got '5\\n'"


def test_an_episode_with_feedback_runs_to_its_end_through_the_runner():
    """Token in, token out: the feedback is tokenized on its own and the second try continues from it."""
    import types

    turns = iter(["print(4)", "print(3)"])

    def generate(contexts, max_tokens, stop, seeds, episodes):
        ids = TOK.encode(next(turns), add_special_tokens=False).ids + [2]
        return [types.SimpleNamespace(token_ids=ids, logp=[0.0] * len(ids), weight_version=0, finish_reason="stop")]

    make = load_environment("rlhf.agents.code:CodeFeedback", {"sandbox": SANDBOX})
    [ep], counts = run_episodes(generate, make, [_row("3")], [TOK.encode("1+2=").ids], TOK,
                                Limits(max_turns=3, max_tokens=64, turn_tokens=16))
    assert ep.status is Status.done and ep.reward == 1.0 and ep.turns == 2
    assert TOK.decode(ep.ids, skip_special_tokens=True) == "print(4)=4?print(3)"


@pytest.mark.parametrize("args,why", [({"feedback": "{nope}"}, "not a template"), ({"decay": 0}, "decay in"),
                                      ({"sandbox": {"timeout": 2}}, "not a reward.sandbox section")])
def test_bad_arguments_are_refused_with_what_to_fix(args, why):
    with pytest.raises(ConfigError, match=why):
        load_environment("rlhf.agents.code:CodeFeedback", args)
