"""The rollout-correction suite against hand-computed cases: token TIS, sequence-level masked IS, geometric-mean
rejection, the token veto, their product in the loss, and the metrics a step logs."""

import math

import pytest
import torch

from rlhf.algorithms.correction import correction_parts, correction_stats, correction_weights
from rlhf.algorithms.losses import truncated_is_weights
from rlhf.algorithms.objective import policy_loss
from rlhf.config import load_run_config
from rlhf.errors import ConfigError
from rlhf.schema import AlgorithmConfig

L2, L3 = math.log(2.0), math.log(3.0)
# three sequences of up to 3 response tokens; log r_t = old - rollout per token (0 where masked)
LOG_R = torch.tensor([[L2, 0.0, -L2],     # R = 1, G = 1
                      [L2, L2, 0.0],      # R = 4, G = 4^(1/2) = 2 (two tokens: the third is padding)
                      [-L3, 0.0, 0.0]])   # R = 1/3, G = 3^(-1/3); r_1 = 1/3
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 1, 1]])
ROLLOUT = torch.full((3, 3), -1.0)
OLD = ROLLOUT + LOG_R


def test_token_tis_clips_each_token():
    w = correction_weights(AlgorithmConfig(tis_cap=1.5), OLD, ROLLOUT, MASK)
    want = torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.5, 1.0], [1 / 3, 1.0, 1.0]])
    assert torch.allclose(w, want, atol=1e-6)
    assert torch.allclose(w, truncated_is_weights(OLD, ROLLOUT, 1.5), atol=1e-6)  # the loss's own TIS, unchanged


def test_sequence_masked_is_weights_inside_the_cap_and_drops_outside():
    parts = correction_parts(AlgorithmConfig(seq_mis_cap=3.5), OLD, ROLLOUT, MASK)
    assert parts["masked"].tolist() == [False, True, False]  # R = 4 > 3.5
    assert torch.allclose(parts["sequence"], torch.tensor([1.0, 0.0, 1 / 3], dtype=torch.float64), atol=1e-9)
    assert torch.allclose(parts["weight"], torch.tensor([[1.0] * 3, [0.0] * 3, [1 / 3] * 3]), atol=1e-6)
    parts = correction_parts(AlgorithmConfig(seq_mis_cap=2.9), OLD, ROLLOUT, MASK)  # 1/3 < 1/2.9: dropped too
    assert parts["masked"].tolist() == [False, True, True]


def test_geometric_rejection_drops_by_the_per_token_mean_and_keeps_weight_one():
    parts = correction_parts(AlgorithmConfig(geo_rs_cap=1.5), OLD, ROLLOUT, MASK)
    assert parts["rejected"].tolist() == [False, True, False]  # G = 1, 2, 3^(-1/3) = 0.69 >= 1/1.5
    assert parts["weight"].tolist() == [[1.0] * 3, [0.0] * 3, [1.0] * 3]
    parts = correction_parts(AlgorithmConfig(geo_rs_cap=1.4), OLD, ROLLOUT, MASK)  # 0.69 < 1/1.4 = 0.714
    assert parts["rejected"].tolist() == [False, True, True]


def test_veto_drops_a_sequence_for_one_token_and_ignores_padding():
    old = OLD.clone()
    old[1, 2] = -100.0  # padding of sequence 1: never vetoes
    parts = correction_parts(AlgorithmConfig(veto_threshold=0.4), old, ROLLOUT, MASK)
    assert parts["vetoed"].tolist() == [False, False, True]  # r = 1/3 < 0.4 in sequence 2; 1/2 in sequence 0 is not
    both = correction_weights(AlgorithmConfig(tis_cap=1.5, veto_threshold=0.4), old, ROLLOUT, MASK)
    assert torch.allclose(both, torch.tensor([[1.5, 1.0, 0.5], [1.5, 1.5, 1.0], [0.0, 0.0, 0.0]]), atol=1e-6)


def test_the_loss_takes_the_product_of_the_suite():
    cfg = AlgorithmConfig(clip_eps_low=10.0, clip_eps_high=10.0, seq_mis_cap=3.5, veto_threshold=0.4)
    logp = OLD.clone().requires_grad_(True)
    adv = torch.tensor([1.0, 2.0, -1.0])
    extras = {"mask": MASK, "advantages": adv, "old_logp": OLD, "rollout_logp": ROLLOUT}
    loss = policy_loss(cfg, logp, torch.zeros(3, 3), extras, normaliser=float(MASK.sum()))
    # ratio 1 everywhere (logp == old); sequence 1 masked (R = 4), sequence 2 vetoed: only sequence 0 counts
    assert loss.item() == pytest.approx(-(1.0 * 3) / 8, abs=1e-6)
    loss.backward()
    assert logp.grad[1:].abs().sum() == 0 and logp.grad[0].abs().sum() > 0


def test_stats_report_the_mismatch_and_each_estimators_share():
    off = correction_stats(AlgorithmConfig(), OLD, ROLLOUT, MASK)
    diffs = [L2, 0.0, -L2, L2, L2, -L3, 0.0, 0.0]
    assert off["correction/logp_diff_mean"] == pytest.approx(sum(diffs) / 8)
    assert off["correction/logp_diff_abs_p99"] == pytest.approx(L3)
    assert off["correction/seq_ratio_log_abs_max"] == pytest.approx(2 * L2)
    assert "correction/weight_mean" not in off
    on = correction_stats(AlgorithmConfig(tis_cap=1.5, seq_mis_cap=3.5, geo_rs_cap=1.4, veto_threshold=0.4),
                          OLD, ROLLOUT, MASK)
    assert on["correction/token_clipped_fraction"] == pytest.approx(3 / 8)
    assert on["correction/seq_masked_fraction"] == pytest.approx(1 / 3)
    assert on["correction/seq_rejected_fraction"] == pytest.approx(2 / 3)
    assert on["correction/seq_vetoed_fraction"] == pytest.approx(1 / 3)
    assert on["correction/weight_mean"] == pytest.approx((1.5 + 1.0 + 0.5) / 8)  # only sequence 0 survives


@pytest.mark.parametrize("override, message", [
    ("algorithm.seq_mis_cap=0.5", r"algorithm.seq_mis_cap = 0.5: must be 0 \(off\) or above 1"),
    ("algorithm.geo_rs_cap=1", r"algorithm.geo_rs_cap = 1(\.0)?: must be 0 \(off\) or above 1"),
    ("algorithm.veto_threshold=1.5", r"algorithm.veto_threshold = 1.5: must be 0 \(off\) or in \(0, 1\)"),
])
def test_bad_thresholds_are_refused_before_anything_starts(override, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config("configs/tiny_cpu.yaml", [override])
