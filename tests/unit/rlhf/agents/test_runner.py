"""The episode loop over a scripted batch generate: token-in-token-out across turns, the calculator tool,
every end status counted (done, max_turns, max_tokens, timeout, env_error), and environments refused by
name when they cannot be loaded."""

import time
import types

import pytest

from rlhf.agents.calculator import ALPHABET, Calculator, evaluate
from rlhf.agents.environment import Observation, load_environment
from rlhf.agents.episode import Limits, Status
from rlhf.agents.runner import run_episodes
from rlhf.data.prompts import PromptRow
from rlhf.data.tokenizer import EOS, build_tokenizer
from rlhf.errors import ConfigError

TOK = build_tokenizer(64, ALPHABET)
EOS_ID = TOK.token_to_id(EOS)


def ids(text):
    return TOK.encode(text, add_special_tokens=False).ids


class Scripted:
    """A batch generate that answers each episode's turns from a script of texts (the policy's turns) and
    records every context it was given, so the test can check what each turn continued from."""

    def __init__(self, scripts):
        self.scripts, self.calls = scripts, []

    def __call__(self, contexts, max_tokens, stop, seeds, episodes):
        self.calls.append((contexts, max_tokens, tuple(stop)))
        outs = []
        for ctx, room in zip(contexts, max_tokens):
            ep = ctx[1]  # each prompt names its row in its second token
            turn = sum(1 for c in self.calls for x in c[0] if x[1] == ep) - 1
            want = ids(self.scripts[int(TOK.id_to_token(ep))][turn])
            toks = want[:room]
            outs.append(types.SimpleNamespace(token_ids=toks, logp=[-0.5] * len(toks), weight_version=7,
                                              token_versions=(), finish_reason="stop" if toks == want else "length"))
        return outs


def _rows(answers):
    return [PromptRow(f"{i}:", a, f"t:{i}") for i, a in enumerate(answers)]


def test_the_calculator_episode_continues_from_its_own_tokens_and_is_scored():
    rows = _rows(["579", "12"])
    prompts = [TOK.encode(r.prompt).ids for r in rows]
    gen = Scripted({0: ["<calc>123+456</calc>", "579"], 1: ["13"]})
    eps, counts = run_episodes(gen, Calculator, rows, prompts, TOK, Limits(max_turns=3, max_tokens=64,
                                                                            turn_tokens=32))
    assert [e.status for e in eps] == [Status.done, Status.done] and [e.reward for e in eps] == [1.0, 0.0]
    assert counts["done"] == 2 and counts["env_steps"] == 3 and counts["token_mismatch"] == 0
    e = eps[0]
    assert e.ids == ids("<calc>123+456</calc>") + ids("<result>579</result>") + ids("579")
    assert e.mask == [1] * 20 + [0] * 20 + [1] * 3
    # the second turn continued from exactly the prompt, the sampled call and the observation's own tokens
    second = gen.calls[1][0][0]
    assert second == list(prompts[0]) + ids("<calc>123+456</calc>") + ids("<result>579</result>")
    assert gen.calls[0][2] == ("</calc>",) and e.versions[:20] == [7] * 20 and e.versions[20] == -1


def test_limits_end_episodes_and_every_status_is_counted():
    rows = _rows(["1", "2"])
    prompts = [TOK.encode(r.prompt).ids for r in rows]
    calls = ["<calc>1+1</calc>"] * 5
    eps, counts = run_episodes(Scripted({0: calls, 1: calls}), Calculator, rows, prompts, TOK,
                               Limits(max_turns=2, max_tokens=200, turn_tokens=32))
    assert [e.status for e in eps] == [Status.max_turns] * 2 and counts["max_turns"] == 2
    assert all(e.turns == 2 and e.trained for e in eps)
    eps, counts = run_episodes(Scripted({0: calls, 1: calls}), Calculator, rows, prompts, TOK,
                               Limits(max_turns=5, max_tokens=40, turn_tokens=32))
    assert counts["max_tokens"] == 2 and all(len(e.prompt_ids) + len(e.ids) <= 40 for e in eps)


class Flaky:
    stop = ("</calc>",)

    def __init__(self, mode="ok"):
        self.mode = mode

    def reset(self, row):
        self.mode = row.answer

    def step(self, text):
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "raise":
            raise RuntimeError("tool down")
        if self.mode == "bad":
            return {"text": "not an Observation"}
        if self.mode == "both":
            return Observation(text="a", token_ids=[5])
        return Observation(done=True, reward=1.0)


def test_environment_faults_end_their_episodes_only_and_never_stall_the_round():
    rows = _rows(["ok", "hang", "raise", "bad", "both"])
    prompts = [TOK.encode(r.prompt).ids for r in rows]
    t0 = time.monotonic()
    eps, counts = run_episodes(Scripted({i: ["1"] for i in range(5)}), Flaky, rows, prompts, TOK,
                               Limits(step_timeout_s=0.5))
    assert time.monotonic() - t0 < 5  # the hung step is left behind, not waited for
    assert [e.status for e in eps] == [Status.done, Status.timeout, Status.env_error, Status.env_error,
                                       Status.env_error]
    assert "tool down" in eps[2].error and "not an rlhf.agents.environment.Observation" in eps[3].error
    assert "both text and token_ids" in eps[4].error
    assert (counts["done"], counts["timeout"], counts["env_error"]) == (1, 1, 3)
    assert [e.trained for e in eps] == [True, False, False, False, False]


def test_an_environment_that_fails_at_reset_is_counted_not_lost():
    class Broken(Flaky):
        def reset(self, row):
            raise KeyError("no such task")

    eps, counts = run_episodes(Scripted({0: ["1"]}), Broken, _rows(["1"]), [TOK.encode("0:").ids], TOK, Limits())
    assert eps[0].status is Status.env_error and "reset" in eps[0].error and counts["env_error"] == 1


def test_the_calculator_evaluates_integer_arithmetic_and_nothing_else():
    assert evaluate("123+456") == 579 and evaluate("(2+3)*-4") == -20 and evaluate(" 7 - 10 ") == -3
    for bad in ("__import__('os')", "2**100", "1/2", "x+1", "1.5+1", "9" * 70, "(" * 200 + "1" + ")" * 200, ""):
        assert evaluate(bad) is None, bad
    calc = Calculator()
    calc.reset(PromptRow("", "5", ""))
    assert calc.step("<calc>2+3</calc>") == Observation(text="<result>5</result>")
    assert calc.step("<calc>2/3</calc>") == Observation(text="<result>error</result>")
    assert calc.step("5") == Observation(done=True, reward=1.0)
    assert calc.step("<calc>2+3</calc> and more") == Observation(done=True, reward=0.0)


def test_environments_are_loaded_by_name_and_refused_with_what_to_change():
    make = load_environment("rlhf.agents.calculator:Calculator", {"close_tag": "</c>"})
    assert make().stop == ("</c>",)
    for spec, args, msg in [("calculator", None, "give 'module:Class'"),
                            ("no_such_module_xyz:Env", None, "does not import"),
                            ("rlhf.agents.calculator:Nope", None, "has no class 'Nope'"),
                            ("rlhf.agents.calculator:evaluate", None, "has no class"),
                            ("rlhf.agents.episode:Limits", None, "has no reset or step"),
                            ("rlhf.agents.calculator:Calculator", {"colour": 1}, "fix agent.environment_args")]:
        with pytest.raises(ConfigError, match=msg):
            load_environment(spec, args)


def test_an_observation_with_a_reward_or_done_that_is_not_one_ends_as_env_error_saying_what_to_give():
    class Odd(Flaky):
        def step(self, text):
            if self.mode == "exit":
                raise SystemExit(3)  # ends its episode, not the run
            return Observation(done=True, reward="yes") if self.mode == "word" else Observation(done=1)

    rows = _rows(["word", "one", "exit"])
    eps, counts = run_episodes(Scripted({i: ["1"] for i in range(3)}), Odd, rows,
                               [TOK.encode(r.prompt).ids for r in rows], TOK, Limits())
    assert [e.status for e in eps] == [Status.env_error] * 3 and counts["env_error"] == 3
    assert "reward='yes': give a finite number or None" in eps[0].error
    assert "done=1: give True or False" in eps[1].error and "SystemExit" in eps[2].error


class Losing:
    """An `Environments` whose worker holding episode 0 dies at its first step (and, for `times` > 1, again at
    each later first step): the episode's outcome is `lost`, the others' answered as a calculator would."""

    stop = ("</calc>",)

    def __init__(self, times=1):
        from rlhf.agents.runner import LocalEnvironments

        self.local, self.times, self.resets = LocalEnvironments(Calculator, 5.0), times, []

    def reset(self, keys, rows):
        self.resets.append(list(keys))
        return self.local.reset(keys, rows)

    def step(self, keys, texts):
        from rlhf.agents.runner import Outcome

        outs = self.local.step(keys, texts)
        if 0 in keys and self.times > 0:
            self.times -= 1
            outs[list(keys).index(0)] = Outcome("lost")
        return outs

    def close(self, keys=None):
        self.local.close(keys)


def test_an_episode_whose_environment_is_lost_begins_again_from_its_prompt():
    """A dead environment worker: its episodes begin again from their prompts on a fresh environment (reset
    again), the others go on; the restarted episode's tokens are its second attempt's alone."""
    rows = _rows(["579", "12"])
    prompts = [TOK.encode(r.prompt).ids for r in rows]
    envs = Losing()
    gen = Scripted({0: ["<calc>123+456</calc>", "<calc>123+456</calc>", "579"], 1: ["12"]})
    eps, counts = run_episodes(gen, envs, rows, prompts, TOK, Limits(max_turns=3, max_tokens=64, turn_tokens=32))
    assert envs.resets == [[0, 1], [0]] and counts["restarted"] == 1 and eps[0].restarts == 1
    assert [e.status for e in eps] == [Status.done, Status.done] and [e.reward for e in eps] == [1.0, 1.0]
    assert eps[0].ids == ids("<calc>123+456</calc>") + ids("<result>579</result>") + ids("579")
    assert eps[0].turns == 2 and len(eps[0].contexts) == 2


def test_an_episode_lost_again_and_again_ends_as_env_error():
    from rlhf.agents.runner import MAX_RESTARTS

    rows = _rows(["579"])
    eps, counts = run_episodes(Scripted({0: ["<calc>1+1</calc>"] * 9}), Losing(times=9), rows,
                               [TOK.encode("0:").ids], TOK, Limits(max_turns=3, max_tokens=64, turn_tokens=32))
    assert eps[0].status is Status.env_error and "lost" in eps[0].error
    assert counts["restarted"] == MAX_RESTARTS and not eps[0].trained


def test_the_flaky_environment_hangs_and_raises_as_asked():
    """`rlhf.agents.flaky:Flaky` (chaos for episodes): its hung calls end their episodes as timeout, its failing
    ones as env_error, and every episode ends with a status."""
    import itertools

    from rlhf.agents import flaky
    from rlhf.agents.flaky import Flaky as Chaos

    flaky._made = itertools.count()  # the environments' draws as in a fresh process
    make = load_environment("rlhf.agents.flaky:Flaky", {"environment": "rlhf.agents.retry:Retry", "hang": 0.2,
                                                        "fail": 0.2, "hang_s": 30, "seed": 2})
    rows = _rows(["1"] * 10)
    t0 = time.monotonic()
    eps, counts = run_episodes(Scripted({i: ["1"] for i in range(10)}), make, rows,
                               [TOK.encode(r.prompt).ids for r in rows], TOK, Limits(step_timeout_s=0.5))
    assert time.monotonic() - t0 < 10
    assert counts["timeout"] > 0 and counts["env_error"] > 0 and counts["done"] > 0, counts
    assert counts["timeout"] + counts["env_error"] + counts["done"] == 10
    with pytest.raises(ValueError, match="probabilities"):
        Chaos("rlhf.agents.retry:Retry", hang=0.8, fail=0.5)


def test_two_batches_share_one_set_of_environments_under_keys_of_their_own():
    """StaleSync's producer and an evaluation run episodes on the same environment workers at once: each call's
    environments live under its own keys (`key_base`), and its end drops only them."""
    import threading

    from rlhf.agents.runner import LocalEnvironments

    shared = LocalEnvironments(Calculator, 5.0)
    seen = []

    class Recording:
        stop = shared.stop

        def reset(self, keys, rows):
            seen.append(("reset", tuple(keys)))
            return shared.reset(keys, rows)

        def step(self, keys, texts):
            seen.append(("step", tuple(keys)))
            time.sleep(0.05)  # the other batch's calls come in meanwhile
            return shared.step(keys, texts)

        def close(self, keys=None):
            seen.append(("close", tuple(keys)))
            shared.close(keys)

    rows = _rows(["579", "12"])
    prompts = [TOK.encode(r.prompt).ids for r in rows]
    script = {0: ["<calc>123+456</calc>", "579"], 1: ["<calc>5+7</calc>", "12"]}
    out = {}

    def batch(base):
        out[base] = run_episodes(Scripted(script), Recording(), rows, prompts, TOK,
                                 Limits(max_turns=3, max_tokens=64, turn_tokens=32), key_base=base)

    started = [threading.Thread(target=batch, args=(base,)) for base in (0, 1 << 32)]
    for t in started:
        t.start()
    for t in started:
        t.join(30)
    for base in (0, 1 << 32):
        eps, counts = out[base]
        assert [e.reward for e in eps] == [1.0, 1.0] and counts["done"] == 2  # neither saw the other's answers
        assert {k for _, keys in seen for k in keys} >= {base, base + 1}
    assert all(set(keys) <= {0, 1} or set(keys) <= {1 << 32, (1 << 32) + 1} for _, keys in seen)
    assert sorted(keys for what, keys in seen if what == "close") == [(0, 1), (1 << 32, (1 << 32) + 1)]
    assert shared.envs == {}  # each dropped its own, nothing more or less


def test_weights_installed_between_turns_tag_the_later_tokens_with_their_version():
    """StaleSync: a sync between two turns of an episode in flight; the later turn's tokens carry the new version,
    observations -1, and the sample the trainer takes says the oldest weights that sampled any of it."""
    from rlhf.driver.episodes import completion

    rows = _rows(["579"])
    prompts = [TOK.encode(r.prompt).ids for r in rows]
    gen = Scripted({0: ["<calc>123+456</calc>", "579"]})

    def generate(contexts, max_tokens, stop, seeds, episodes):
        outs = gen(contexts, max_tokens, stop, seeds, episodes)
        version = 3 + len(gen.calls)  # one install between the turns
        return [types.SimpleNamespace(**(vars(o) | {"weight_version": version, "routes": f"turn {len(gen.calls)}"}))
                for o in outs]

    (e,), _ = run_episodes(generate, Calculator, rows, prompts, TOK, Limits(max_turns=3, max_tokens=64,
                                                                            turn_tokens=32))
    assert e.status is Status.done and e.versions == [4] * 20 + [-1] * 20 + [5] * 3
    c = completion(e, 0)
    assert c.weight_version == 4 and c.token_versions == tuple(e.versions) and c.loss_mask == tuple(e.mask)
    assert e.routes == c.routes == "turn 2"  # the last turn's routes: they cover its whole context
    e.restart()
    assert e.routes is None and completion(e, 0).routes is None
