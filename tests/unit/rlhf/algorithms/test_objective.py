"""The objective: micro-batch losses with a global normaliser add up to the whole mini-batch's loss,
for every aggregation; the KL term and the KL-in-reward penalty behave as the maths says."""

import pytest
import torch

from rlhf.algorithms.objective import LossRecord, advantages, kl_reward_penalty, loss_normaliser, policy_loss
from rlhf.schema import AlgorithmConfig, Estimator, LossAggregation


def _batch(B=6, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return {"mask": mask, "advantages": torch.randn(B, generator=g), "old_logp": -torch.rand(B, T, generator=g),
            "ref_logp": -torch.rand(B, T, generator=g), "rollout_logp": -torch.rand(B, T, generator=g)}


def _split(extras, rows):
    return {k: v[rows] for k, v in extras.items()}


@pytest.mark.parametrize("cfg", [
    AlgorithmConfig(),
    AlgorithmConfig(loss_aggregation=LossAggregation.seq_mean_token_mean, kl_coef=0.1, entropy_coef=0.01),
    AlgorithmConfig(estimator=Estimator.gspo),
    AlgorithmConfig(estimator=Estimator.dapo, clip_eps_high=0.28, tis_cap=2.0, kl_coef=0.05),
])
def test_micro_batch_losses_sum_to_the_mini_batch_loss(cfg):
    extras = _batch()
    logp = (extras["old_logp"] + 0.3 * torch.randn(6, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
    ent = torch.rand(6, 5)
    n = loss_normaliser(cfg, extras["mask"])
    whole = policy_loss(cfg, logp, ent, extras, n)
    parts = sum(policy_loss(cfg, logp[r], ent[r], _split(extras, r), n) for r in ([0, 1, 2], [3, 4, 5]))
    assert torch.allclose(whole, parts, atol=1e-6)


def test_on_policy_gradient_is_advantage_weighted_logprob_gradient():
    cfg = AlgorithmConfig()  # token_mean, no KL
    extras = _batch()
    logp = extras["old_logp"].clone().requires_grad_()
    rec = LossRecord()
    policy_loss(cfg, logp, torch.zeros(6, 5), extras, loss_normaliser(cfg, extras["mask"]), rec).backward()
    expect = -extras["advantages"][:, None] * extras["mask"] / extras["mask"].sum()
    assert torch.allclose(logp.grad, expect, atol=1e-7)
    assert rec.clip_fraction == 0 and abs(rec.ratio / rec.tokens - 1) < 1e-6


def test_kl_term_is_zero_at_the_reference_and_penalty_is_per_sequence():
    cfg = AlgorithmConfig(kl_coef=0.5)
    extras = _batch()
    extras["ref_logp"] = extras["old_logp"]
    rec = LossRecord()
    policy_loss(cfg, extras["old_logp"].clone(), torch.zeros(6, 5), extras, 1.0, rec)
    assert rec.kl == 0
    pen = kl_reward_penalty(AlgorithmConfig(kl_coef=0.5, kl_estimator=cfg.kl_estimator.k1),
                            torch.zeros(2, 3), torch.full((2, 3), -1.0), torch.ones(2, 3))
    assert pen.tolist() == [1.5, 1.5]  # 0.5 * sum over 3 tokens of (logp - ref_logp) = 0.5 * 3


def test_estimators_choose_their_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    grpo = advantages(AlgorithmConfig(), r)
    assert grpo[4:].abs().max() == 0 and grpo[:4].sum().abs() < 1e-6
    rpp = advantages(AlgorithmConfig(estimator=Estimator.reinforce_pp), r)
    assert rpp.mean().abs() < 1e-6 and abs(float(rpp.std()) - 1) < 1e-4


def test_kl_ignores_the_reference_outside_the_response():
    """A reference known only at the response tokens (0 elsewhere: StaleSync computes it ahead) gives the same
    loss and gradients as the full one, with no overflow where the policy's logprob is very low (k3's exp)."""
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k3")
    extras = _batch()
    mask = extras["mask"]
    logp = (-torch.rand(mask.shape) - 100 * (1 - mask)).requires_grad_()  # -100 outside: exp(100) overflows
    ahead = dict(extras, ref_logp=extras["ref_logp"] * mask)
    losses, grads = [], []
    for ex in (extras, ahead):
        loss = policy_loss(cfg, logp, torch.zeros_like(logp), ex, loss_normaliser(cfg, mask))
        (g,) = torch.autograd.grad(loss, logp)
        losses.append(loss.detach())
        grads.append(g)
    assert torch.isfinite(losses[1]) and torch.isfinite(grads[1]).all()
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    pen = [kl_reward_penalty(cfg, logp.detach(), ex["ref_logp"], mask) for ex in (extras, ahead)]
    assert torch.equal(pen[0], pen[1]) and torch.isfinite(pen[1]).all()
