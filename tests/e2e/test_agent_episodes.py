"""Multi-turn episodes on a real vLLM engine, token in and token out: every turn continues from the episode's
own ids, the recorded ids are what the engine sampled, and each sampled token's recorded logprob is the
engine's own for that token given exactly the episode's context."""

import os

import pytest
import torch

from rlhf.agents.calculator import ALPHABET
from rlhf.agents.environment import Observation
from rlhf.agents.episode import Limits, Status
from rlhf.agents.runner import run_episodes
from rlhf.config import load_model_config
from rlhf.data.prompts import PromptRow
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.schema import RolloutConfig

pytestmark = pytest.mark.vllm
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


class Tool:
    """Answers every turn with a tool result, and ends the episode after its third turn."""

    stop = ("</calc>",)

    def reset(self, row):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        if self.turns == 3:
            return Observation(done=True, reward=1.0)
        return Observation(text=f"<result>{len(text)}</result>")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from actors.vllm.engine import VLLMEngine

    d = tmp_path_factory.mktemp("agent")
    cfg = load_model_config(os.path.join(CONFIGS, "model", "qwen3_moe_tiny.yaml"), ["vocab_size=64"])
    m = Qwen3MoeForCausalLM(cfg).eval()
    m.init_weights(3, std=0.1)
    tok = build_tokenizer(64, ALPHABET)
    save_tokenizer(tok, d)
    save_pretrained(m, d)
    e = VLLMEngine(str(d), RolloutConfig(cpu_kv_cache_gib=0.25, temperature=1.0, block_size=32), max_model_len=128,
                   whole_prefills=True, log_stats=True)
    yield e, tok
    e.close()


@pytest.mark.parametrize("stepwise", [False, True], ids=["whole", "stepwise"])
def test_episodes_on_an_engine_continue_from_their_own_tokens(engine, stepwise, monkeypatch):
    """`stepwise`: the engine stepped by the actor one decode step at a time, as StaleSync's partial rollouts
    run it: the same continuity, cached prefix and first-token times."""
    e, tok = engine
    monkeypatch.setattr(e, "interruptible", stepwise)
    assert e.llm.reset_prefix_cache()  # nothing cached by an earlier test's episodes (the same seeds and prompts)
    rows = [PromptRow(f"{i}+{i}=", str(2 * i), f"t:{i}") for i in range(4)]
    prompts = [tok.encode(r.prompt).ids for r in rows]
    calls = []

    def generate(contexts, max_tokens, stop, seeds, episodes):
        calls.append([list(c) for c in contexts])
        return e.generate(contexts, n=1, max_tokens=max_tokens, stop=stop, seed=seeds)

    limits = Limits(max_turns=4, max_tokens=120, turn_tokens=24)
    eps, counts = run_episodes(generate, Tool, rows, prompts, tok, limits, seed=5)
    assert counts["token_mismatch"] == 0 and counts["done"] + counts["max_tokens"] == 4
    assert any(ep.turns == 3 and ep.status is Status.done for ep in eps)
    assert any(c > 0 for ep in eps for c in ep.cached[1:])  # the prefix cache served later turns
    for ep in eps:
        s = ep.sample()  # verified
        # each turn after the first was handed exactly the episode's prefix: prompt, sampled and observed ids
        for k, start in enumerate(ep.turn_starts):
            assert list(ep.prompt_ids) + ep.ids[:start] in calls[k]
        # the recorded logprobs are the engine's own for those tokens in that exact context
        full = list(ep.prompt_ids) + ep.ids
        scored = torch.tensor(e.sequence_logprobs([full])[0])[len(ep.prompt_ids) - 1:]
        m = torch.tensor(s["mask"], dtype=torch.bool)
        assert torch.allclose(torch.tensor(s["logp"])[m], scored[m], atol=1e-4)
        assert all(v == 0 for v, keep in zip(s["versions"], s["mask"]) if keep)
        # a later turn reads what earlier turns computed from the prefix cache: every whole 32-token block of
        # the previous turn's context and sampled tokens (the last sampled token has no KV entry yet)
        for k in range(1, ep.turns):
            computed = ep.contexts[k - 1] + sum(ep.mask[ep.turn_starts[k - 1]:ep.turn_starts[k]]) - 1
            assert ep.cached[k] == computed // 32 * 32
        # with vLLM's timings, every later turn's first token came out after the observation it read
        waits = ep.observation_latencies()
        assert len(waits) == ep.turns - 1 and all(0 < w < 60 for w in waits)


def test_the_chat_endpoint_records_what_the_engine_sampled(engine):
    """A two-turn session driven by a plain HTTP client (`rlhf.agents.chat_agent.chat`): the session's ids are
    the first request's rendering, the engine's sampled ids as they came and the second message tokenized on its
    own; the recorded logprobs are the engine's own for those tokens in that context."""
    from rlhf.agents.chat_agent import chat
    from rlhf.agents.endpoint import ChatEndpoint

    e, tok = engine

    def generate(contexts, max_tokens, stop, seeds, episodes):
        return e.generate(contexts, n=1, max_tokens=max_tokens, stop=stop, seed=seeds)

    ep = ChatEndpoint(generate, tok, Limits(max_turns=3, max_tokens=120, turn_tokens=12))
    try:
        url = ep.open(0, PromptRow("12+34=", "46", "t:0"))
        msgs = [{"role": "user", "content": "12+34="}]
        first = chat(url, ep.token, msgs)["choices"][0]["message"]["content"]
        msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "<result>7</result>"}]
        chat(url, ep.token, msgs, stop=["</calc>"])
        s = ep.session_of(0).episode
    finally:
        ep.close()
    assert s.turns == 2 and list(s.prompt_ids) == tok.encode("12+34=").ids
    obs = tok.encode("<result>7</result>", add_special_tokens=False).ids
    before = s.ids[:s.turn_starts[1]]  # the first turn as sampled, then the second message on its own
    assert before[-len(obs):] == obs and tok.decode(before[:-len(obs)], skip_special_tokens=True) == first
    assert s.mask == [1] * (len(before) - len(obs)) + [0] * len(obs) + [1] * (len(s.ids) - len(before))
    full = list(s.prompt_ids) + s.ids
    scored = torch.tensor(e.sequence_logprobs([full])[0])[len(s.prompt_ids) - 1:]
    m = torch.tensor(s.mask, dtype=torch.bool)
    assert torch.allclose(torch.tensor(s.logp)[m], scored[m], atol=1e-4)
