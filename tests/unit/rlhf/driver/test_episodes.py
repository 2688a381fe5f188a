"""A step's rollouts as episodes: G episodes per prompt run turn by turn, each group's turns on one engine,
rewarded by the environment; the batch trains on sampled tokens only; broken episodes are counted, kept out
of the loss and out of their group's baseline. The engines are an in-process stand-in that answers right or
wrong by each turn's seed (the engines themselves: tests/e2e/test_agent_episodes.py)."""

import torch

from actors.vllm.engine import Completion
from rlhf.agents.retry import Retry
from rlhf.batch import TokenBatch
from rlhf.config import load_run_config
from rlhf.data.prompts import PromptRow
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenizer import build_tokenizer
from rlhf.driver.episodes import collect_episodes

TOK = build_tokenizer(32)
EOS = 2


class StandInRoles:
    """Two engines; a turn's answer is right when its seed is even, else the right answer with a 9 appended."""

    def __init__(self):
        self.calls = []  # per call: [(context, engine)]

    def generate(self, prompts, n, seed, seeds=None, engine_of=None, max_tokens=None, stop=None, **kw):
        assert n == 1 and len(seeds) == len(engine_of) == len(max_tokens) == len(prompts) and stop == []
        self.calls.append([(tuple(p), e % 2) for p, e in zip(prompts, engine_of)])
        out = []
        for i, p in enumerate(prompts):
            question = TOK.decode(list(p), skip_special_tokens=True).split("=")[0]
            answer = str(sum(int(x) for x in question.split("+")))
            ids = tuple(TOK.encode(answer if seeds[i] % 2 == 0 else answer + "9", add_special_tokens=False).ids)
            ids = (ids + (EOS,))[:max_tokens[i]]
            # a prefix cache of whole 4-token blocks: what an earlier turn of the episode computed
            out.append(Completion(i, ids, tuple([-0.1] * len(ids)), "stop", 3, cached_tokens=len(p) // 4 * 4))
        return out


class Picky(Retry):
    """Retry, but its tool is down for one question."""

    def step(self, text):
        if self.answer == "7":
            raise ConnectionError("tool down")
        return super().step(text)


def _cfg(env, G=4, P=3):
    return load_run_config("configs/tiny_cpu.yaml", [f"agent.environment={env}", "agent.max_turns=3",
                                                     "agent.max_tokens=80", f"algorithm.group_size={G}",
                                                     f"data.prompts_per_step={P}", "algorithm.dynamic_sampling=false",
                                                     "data.gen_prompts_per_step=0", f"trainer.mini_batch_size={P * G}"])


def _rows():
    return [PromptRow(f"{a}+{b}=", str(a + b), f"t:{a}") for a, b in [(12, 30), (3, 4), (20, 5)]]


def test_episodes_make_a_rollout_that_trains_on_sampled_tokens_only():
    cfg = _cfg("rlhf.agents.retry:Retry")
    roles = StandInRoles()
    ro = collect_episodes(cfg, roles, PromptSampler(_rows(), 3, seed=0), TOK, step=1)
    P, G = 3, 4
    assert ro["rewards_PG"].shape == (P, G) and len(ro["completions"]) == P * G
    for k, c in enumerate(ro["completions"]):
        assert c.prompt_index == k // G
        mask = torch.tensor(c.loss_mask)
        # a turn is an answer and EOS; the feedback " ?" is observed between turns, never trained on
        observed = [t for t, m in zip(c.token_ids, c.loss_mask) if not m]
        assert observed == TOK.encode(" ?" * (len(observed) // 2), add_special_tokens=False).ids
        assert [v for v, m in zip(c.token_versions, c.loss_mask) if not m] == [-1] * len(observed)
        done = c.finish_reason == "done"
        assert float(ro["rewards_PG"].view(-1)[k]) == (1.0 if done else 0.0)
        assert int(mask.sum()) + len(observed) == len(c.token_ids)
    # every turn of a group went to the one engine its group was given
    engines = {}
    for call in roles.calls:
        for ctx, e in call:
            assert engines.setdefault(ctx[:6], e) == e
    assert len(set(engines.values())) == 2
    m = ro["agent"]
    assert m["agent/token_mismatch"] == 0 and abs(sum(v for k, v in m.items() if k.startswith("agent/episodes_"))
                                                  - 1) < 1e-9
    # turns after the first (their contexts hold feedback): the share of their context the cache served
    later = [len(ctx) for call in roles.calls for ctx, _ in call if TOK.token_to_id("?") in ctx]
    assert later and m["agent/prefix_cache_hit_rate"] == sum(n // 4 * 4 for n in later) / sum(later)
    assert m["agent/sampled_tokens"] == ro["generated_tokens"] == sum(sum(c.loss_mask) for c in ro["completions"])
    prompts = [ro["prompt_ids"][i // G] for i in range(P * G)]
    b = TokenBatch.from_samples(prompts, [c.token_ids for c in ro["completions"]],
                                [c.logp for c in ro["completions"]], loss_masks=[c.loss_mask for c in ro["completions"]])
    assert int(b.mask_BT.sum()) == m["agent/sampled_tokens"]


def test_an_environment_fault_is_counted_untrained_and_out_of_the_baseline():
    cfg = _cfg("tests.unit.rlhf.driver.test_episodes:Picky")
    ro = collect_episodes(cfg, StandInRoles(), PromptSampler(_rows(), 3, seed=0), TOK, step=2)
    broken = [i for i, r in enumerate(ro["rows"]) if r.answer == "7"][0]
    G = 4
    for c in ro["completions"][broken * G:(broken + 1) * G]:
        assert c.finish_reason == "env_error" and not any(c.loss_mask)
    assert ro["agent"]["agent/episodes_env_error"] == G / (3 * G)
    assert torch.all(ro["rewards_PG"][broken] == 0)  # no trained episode in the group: the baseline is 0
    assert torch.equal(ro["scores_PG"][broken], torch.zeros(G))
