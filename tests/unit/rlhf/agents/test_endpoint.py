"""The OpenAI-compatible chat endpoint (`rlhf.agents.endpoint`) over a scripted batch generate, driven by plain
HTTP: a session's token ids are its first request's rendering, the sampled ids and each later message tokenized
on its own, never a re-rendering; requests that break that, bad tokens and paths are refused; agent functions
end with a status."""

import json
import threading
import time
import types
import urllib.error
import urllib.request

import pytest

from rlhf.agents.chat_agent import chat, retry
from rlhf.agents.endpoint import ChatEndpoint, ChatFormat, load_function, run_agent_function
from rlhf.agents.episode import Limits, Status
from rlhf.data.prompts import PromptRow
from rlhf.data.tokenizer import ALPHABET, build_tokenizer
from rlhf.errors import ConfigError

TOK = build_tokenizer(32, ALPHABET)
LIMITS = Limits(max_turns=3, max_tokens=64, turn_tokens=8, step_timeout_s=2.0)


class Answers:
    """A batch generate answering every context with the next text of its episode's script."""

    def __init__(self, scripts):
        self.scripts, self.turns, self.calls = scripts, {}, []

    def __call__(self, contexts, max_tokens, stop, seeds, episodes):
        self.calls.append([list(c) for c in contexts])
        outs = []
        for ctx, room, ep in zip(contexts, max_tokens, episodes):
            k = self.turns[ep] = self.turns.get(ep, -1) + 1
            ids = (TOK.encode(self.scripts[ep][k], add_special_tokens=False).ids + [2])[:room]
            outs.append(types.SimpleNamespace(token_ids=ids, logp=[-0.25] * len(ids), weight_version=3,
                                              finish_reason="stop"))
        return outs


def _ids(text):
    return TOK.encode(text, add_special_tokens=False).ids


def test_a_two_turn_session_records_exactly_the_tokens_sampled_and_sent():
    gen = Answers({0: ["12", "579"]})
    ep = ChatEndpoint(gen, TOK, LIMITS)
    try:
        url = ep.open(0, PromptRow("123+456=", "579", "t:0"))
        first = [{"role": "user", "content": "123+456="}]
        r1 = chat(url, ep.token, first)
        assert r1["choices"][0]["message"]["content"] == "12" and r1["usage"]["prompt_tokens"] == 9
        second = first + [{"role": "assistant", "content": "12"}, {"role": "user", "content": " ?"}]
        assert chat(url, ep.token, second)["choices"][0]["message"]["content"] == "579"
        e = ep.session_of(0).episode
        assert list(e.prompt_ids) == TOK.encode("123+456=").ids
        assert e.ids == _ids("12") + [2] + _ids(" ?") + _ids("579") + [2]
        assert e.mask == [1, 1, 1, 0, 0, 1, 1, 1, 1] and e.versions[:3] == [3, 3, 3] and e.versions[3] == -1
        # the second turn was sampled from the session's ids as they were, the reply's EOS included
        assert gen.calls[1][0] == list(e.prompt_ids) + _ids("12") + [2] + _ids(" ?")
        e.verify()
    finally:
        ep.close()


def _post(url, token, body, path="/chat/completions"):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_requests_that_break_the_session_or_lack_the_token_are_refused_saying_why():
    ep = ChatEndpoint(Answers({0: ["12", "3"], 1: ["4"]}), TOK, LIMITS)
    try:
        url = ep.open(0, PromptRow("1+2=", "3", "t:0"))
        msgs = [{"role": "user", "content": "1+2="}]
        assert _post(url, "wrong", {"messages": msgs})[0] == 401
        assert _post(url, ep.token, {"messages": msgs}, path="/completions")[0] == 404
        assert _post(url.replace(url.split("/")[-2], "nosuch"), ep.token, {"messages": msgs})[0] == 404
        assert _post(url, ep.token, {"messages": [{"role": "robot", "content": "x"}]})[0] == 400
        assert _post(url, ep.token, {"messages": msgs})[0] == 200
        # the assistant's reply sent back changed: the earlier turn would be re-rendered; refused, never trained
        code, body = _post(url, ep.token, {"messages": msgs + [{"role": "assistant", "content": "13"},
                                                               {"role": "user", "content": " ?"}]})
        assert code == 409 and "differs from what the session holds" in body["error"]["message"]
        assert ep.session_of(0).episode.status is Status.token_mismatch
        assert _post(url, ep.token, {"messages": msgs})[0] == 409  # the episode is over
    finally:
        ep.close()


def test_the_session_ends_at_its_limits():
    ep = ChatEndpoint(Answers({0: ["1", "2", "3", "4"]}), TOK, Limits(max_turns=2, max_tokens=64, turn_tokens=4))
    try:
        url = ep.open(0, PromptRow("1+2=", "3", "t:0"))
        msgs = [{"role": "user", "content": "1+2="}]
        for turn in range(2):
            reply = chat(url, ep.token, msgs)["choices"][0]["message"]["content"]
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": " ?"}]
        code, body = _post(url, ep.token, {"messages": msgs})
        assert code == 400 and "agent.max_turns=2" in body["error"]["message"]
        assert ep.session_of(0).episode.status is Status.max_turns
    finally:
        ep.close()


def test_agent_functions_are_run_per_row_and_every_episode_gets_a_status():
    rows = [PromptRow("1+2=", "3", f"t:{i}") for i in range(6)]

    def agent(row, base_url, api_key):
        i = int(row.source[2:])
        if i == 1:
            raise RuntimeError("agent broke")
        if i == 2:
            chat(base_url, api_key, [{"role": "user", "content": row.prompt}])
            return "three"
        if i == 3:
            return 1.0  # asked nothing
        if i == 4:
            time.sleep(30)  # hangs: past agent.step_timeout_s, left behind
        return retry(row, base_url, api_key)

    gen = Answers({i: ["5", "3", "3"] for i in range(6)})
    t0 = time.monotonic()
    eps, counts = run_agent_function(agent, gen, TOK, rows, LIMITS)
    assert time.monotonic() - t0 < 10
    assert [e.status for e in eps] == [Status.done, Status.env_error, Status.env_error, Status.env_error,
                                       Status.timeout, Status.done]
    assert eps[0].reward == 0.5 and eps[0].turns == 2  # right at the second try
    assert "agent broke" in eps[1].error and "returned 'three'" in eps[2].error and "no request" in eps[3].error
    assert counts["done"] == 2 and counts["env_steps"] == 5 and sum(len(c) for c in gen.calls) == 5
    assert threading.active_count() < 50


def test_agent_functions_and_chat_formats_are_refused_by_name(tmp_path):
    from rlhf.config import load_run_config

    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_function("rlhf.agents.chat_agent:nope")
    (tmp_path / "run.yaml").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "run.yaml", ["agent.function=rlhf.agents.chat_agent:retry",
                                                "agent.environment=rlhf.agents.retry:Retry",
                                                "data.max_prompt_tokens=16"])
    assert "set one" in str(e.value)
    with pytest.raises(ConfigError, match="agent.chat_roles"):
        load_run_config(tmp_path / "run.yaml", ["agent.function=rlhf.agents.chat_agent:retry",
                                                "agent.chat_roles={user: '{text}'}", "data.max_prompt_tokens=16"])
    fmt = ChatFormat({"user": "<u>{content}</u>"}, "<a>")
    assert fmt.render([{"role": "user", "content": "hi"}]) == "<u>hi</u><a>"


def test_every_episode_of_a_step_may_talk_to_the_endpoint_at_once():
    """512 agents connecting together (a step's episodes): none refused, every turn answered in batches."""
    rows = [PromptRow("1+2=", "3", f"t:{i}") for i in range(512)]
    gen = Answers({i: ["5", "4", "3"] for i in range(512)})
    eps, counts = run_agent_function(retry, gen, TOK, rows, LIMITS)
    assert counts["done"] == 512 and counts["env_steps"] == 3 * 512 and all(e.reward == 0.25 for e in eps)
    assert len(gen.calls) < 3 * 512 / 8  # batched: many sessions' turns per generate call
