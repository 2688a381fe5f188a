import math

import pytest
import torch

from rlhf.algorithms.advantages import (
    grpo_advantages, nonzero_variance_groups, overlong_penalty, reinforce_pp_advantages,
)
from rlhf.algorithms.losses import aggregate, gspo_loss, kl_penalty, ppo_clip_loss, truncated_is_weights
from rlhf.schema import KLEstimator, LossAggregation


def test_grpo_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = grpo_advantages(r)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    assert torch.allclose(a[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(a[1], torch.zeros(4))  # no signal in an all-equal group
    assert torch.equal(grpo_advantages(r, normalize_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert nonzero_variance_groups(r).tolist() == [True, False]
    rpp = reinforce_pp_advantages(r)
    assert abs(float(rpp.mean())) < 1e-6 and abs(float(rpp.std()) - 1) < 1e-4


def test_ppo_clip_uses_separate_epsilons():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1 against old_logp 0
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    pos = ppo_clip_loss(logp, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.28)
    # A > 0: min(r, clip(r)) -> 1.28, 0.5, 1.1
    assert float(pos.loss) == pytest.approx(-(1.28 + 0.5 + 1.1) / 3, rel=1e-6)
    assert pos.clip_fraction == pytest.approx(1 / 3)
    neg = ppo_clip_loss(logp, old, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28)
    # A < 0: min(-r, -clip(r)) = -max(r, clip(r)) -> -1.5, -0.8, -1.1
    assert float(neg.loss) == pytest.approx((1.5 + 0.8 + 1.1) / 3, rel=1e-6)


def test_ppo_gradient_is_policy_gradient_at_ratio_one():
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ppo_clip_loss(logp, logp.detach(), adv, mask, 0.2, 0.2).loss.backward()
    assert torch.allclose(logp.grad, -adv[:, None] * mask / 3)


def test_aggregations():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(aggregate(x, m, LossAggregation.token_mean)) == pytest.approx(10 / 4)
    assert float(aggregate(x, m, LossAggregation.seq_mean_token_mean)) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(x, m, LossAggregation.seq_mean_token_sum)) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(x, m, LossAggregation.token_mean, normaliser=8)) == pytest.approx(10 / 8)


def test_gspo_sequence_ratio():
    logp = torch.tensor([[math.log(2.0), 0.0]])
    out = gspo_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.2)
    assert out.ratio_mean == pytest.approx(math.sqrt(2.0), rel=1e-6)  # exp(mean log ratio)
    assert float(out.loss) == pytest.approx(-1.2, rel=1e-6) and out.clip_fraction == 1.0


def test_kl_estimators_and_tis():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert torch.allclose(kl_penalty(logp, ref, KLEstimator.k1), logp - ref)
    k3 = kl_penalty(logp, ref, KLEstimator.k3)
    assert (k3 >= 0).all() and torch.allclose(k3, torch.exp(ref - logp) - 1 - (ref - logp))
    assert torch.equal(kl_penalty(logp, logp, KLEstimator.k3), torch.zeros(2))
    w = truncated_is_weights(torch.tensor([0.0, 0.0]), torch.tensor([-3.0, 1.0]), cap=2.0)
    assert torch.allclose(w, torch.tensor([2.0, math.exp(-1.0)]))


def test_overlong_penalty():
    lengths = torch.tensor([10, 17, 20])
    assert torch.allclose(overlong_penalty(lengths, 20, 4, 1.0), torch.tensor([0.0, -0.25, -1.0]))
