"""Episodes as token ids: assembly (masks, logprobs, versions), limits and statuses, the token-fidelity check,
and the loss over a masked episode against its sampled spans one by one."""

import os

import pytest
import torch

from rlhf.agents.episode import Episode, Limits, Status, TokenMismatch
from rlhf.batch import TokenBatch
from rlhf.data.prompts import PromptRow

ROW = PromptRow("2+2=", "4", "t:1")


def _episode(limits=Limits(max_turns=3, max_tokens=20, turn_tokens=5)):
    return Episode(0, ROW, (1, 7, 8), limits)


def test_turns_and_observations_make_one_sample_with_its_loss_mask():
    ep = _episode()
    ep.sampled(ep.context(), [10, 11], [-0.5, -0.25], versions=3)
    assert ep.observed([20, 21, 22])
    ep.sampled(ep.context(), [12], [-1.0], versions=[4])
    ep.end(Status.done, reward=1.0)
    s = ep.sample()
    assert s["prompt"] == [1, 7, 8] and s["response"] == [10, 11, 20, 21, 22, 12]
    assert s["mask"] == [1, 1, 0, 0, 0, 1]
    assert s["logp"] == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert s["versions"] == [3, 3, -1, -1, -1, 4]
    assert (s["reward"], s["trained"], s["status"], s["turns"]) == (1.0, True, "done", 2)

    b = TokenBatch.from_samples([s["prompt"]], [s["response"]], [s["logp"]], loss_masks=[s["mask"]])
    # position t predicts token t+1: the prompt's last position predicts the first response token
    assert b.mask_BT[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]
    assert b.response_rows(b.rollout_logp_BT) == [[-0.5, -0.25, -1.0]]  # the sampled tokens' alone


def test_a_turn_sampled_from_a_retokenized_context_is_caught_and_refused():
    """The drift the token rule prevents: a conversation re-rendered from text and tokenized again differs
    from the ids the policy produced (here a separator the tokenizer merged): the turn is refused, the
    episode ends as token_mismatch and is never trained on."""
    ep = _episode()
    ep.sampled(ep.context(), [10, 11], [-0.1, -0.2], versions=0)
    ep.observed([20, 21])
    rerendered = ep.context()[:-2] + [25]  # "20 21" came back as one token
    with pytest.raises(TokenMismatch, match="differs from the episode.s at token 5"):
        ep.sampled(rerendered, [12], [-0.3], versions=0)
    assert ep.status is Status.token_mismatch and not ep.trained and ep.reward == 0.0
    with pytest.raises(RuntimeError, match="over"):
        ep.sampled(ep.context(), [12], [-0.3], versions=0)


def test_verify_refuses_records_that_do_not_line_up():
    ep = _episode()
    ep.sampled(ep.context(), [10, 11], [-0.1, -0.2], versions=0)
    ep.logp.append(0.0)  # a record out of step with the tokens
    with pytest.raises(TokenMismatch, match="2 tokens but 2 mask, 3 logprob"):
        ep.sample()
    ep = _episode()
    ep.sampled(ep.context(), [10], [-0.1], versions=0)
    ep.contexts[0] = 2  # claims it was sampled from a shorter context
    with pytest.raises(TokenMismatch, match="turn 0 was sampled from 2 tokens"):
        ep.verify()


def test_limits_end_episodes_with_a_status_and_the_stated_training_rule():
    ep = _episode(Limits(max_turns=2, max_tokens=12, turn_tokens=4))
    assert ep.room() == 4
    ep.sampled(ep.context(), [10, 11, 12, 13], [0.0] * 4, versions=0)
    assert ep.room() == 4  # 7 of 12 tokens used: 5 left, a turn's cap 4
    assert not ep.observed([20] * 5)  # 12 tokens: no room for a sampled one
    assert ep.status is Status.max_tokens and ep.trained and ep.reward == 0.0
    for status in (Status.timeout, Status.env_error):
        ep = _episode()
        ep.end(status, reward=1.0, error="x")
        assert not ep.trained and ep.reward == 0.0  # an environment's fault teaches nothing
    ep = _episode()
    ep.end(Status.max_turns)
    ep.end(Status.done, reward=1.0)  # the first end stands
    assert ep.status is Status.max_turns


def test_loss_masks_must_match_the_responses():
    with pytest.raises(ValueError, match="one 0/1 entry per response token"):
        TokenBatch.from_samples([[1, 2]], [[3, 4, 5]], loss_masks=[[1, 0]])


def test_the_loss_over_a_masked_episode_equals_its_sampled_spans_one_by_one():
    """A masked episode's token-mean policy loss and its gradient equal those of its sampled spans, each as a
    sample of its own whose prompt is everything before it (a causal model's logprobs of a span depend on
    its prefix alone), in fp32 to rounding."""
    from rlhf.algorithms.objective import loss_normaliser, policy_loss
    from rlhf.config import load_model_config
    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
    from rlhf.parallel.trainer import token_logprobs
    from rlhf.schema import AlgorithmConfig

    cfg = load_model_config(os.path.join(os.path.dirname(__file__), *[".."] * 4, "configs", "model",
                                         "qwen3_moe_tiny.yaml"))
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(0, std=0.1)
    prompt = [1, 5, 6, 7]
    turns = [([9, 10, 11], [4, 12]), ([13, 14], [15, 16, 17]), ([18], [])]  # (sampled, observation)
    response, mask, spans, prefix = [], [], [], list(prompt)
    for sampled, obs in turns:
        spans.append((list(prefix), sampled))
        response += sampled + obs
        mask += [1] * len(sampled) + [0] * len(obs)
        prefix += sampled + obs
    algo = AlgorithmConfig()

    def loss_of(batch, adv):
        model.zero_grad()
        logp, _ = token_logprobs(model(batch.input_ids_BT, batch.attention_mask_BT), batch.input_ids_BT)
        ent = torch.zeros_like(logp)
        extras = {"mask": batch.mask_BT, "advantages": torch.full((len(batch),), adv)}
        loss = policy_loss(algo, logp, ent, extras, loss_normaliser(algo, batch.mask_BT))
        loss.backward()
        return loss.detach(), model.lm_head.weight.grad.clone()

    whole = TokenBatch.from_samples([prompt], [response], loss_masks=[mask])
    one_by_one = TokenBatch.from_samples([p for p, _ in spans], [s for _, s in spans])
    assert whole.response_tokens == one_by_one.response_tokens == 6
    l1, g1 = loss_of(whole, 0.7)
    l2, g2 = loss_of(one_by_one, 0.7)
    assert torch.allclose(l1, l2, atol=1e-6) and torch.allclose(g1, g2, atol=1e-6)
