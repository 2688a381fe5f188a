import pytest
import torch

from rlhf.parity import logprob_parity, parity_problem


def test_parity_masks_and_reports():
    a = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
    b = torch.tensor([[-1.0, -2.5, -9.0], [-0.25, -0.5, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    p = logprob_parity(a, b, m)
    assert (p.max_abs_diff, p.tokens) == (0.5, 4) and p.mean_abs_diff == pytest.approx(0.1875)
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_parity(a, b[:, :2], m)


def test_one_near_tie_is_reported_but_not_judged_a_broken_sync():
    """A healthy fp32 run: kernel rounding (~1e-7) everywhere and one token whose router picked another
    expert (1.7e-2, as seen on the small model). The max shows it; the p99 that the warning judges does not."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(64, 128, generator=g, dtype=torch.float64)
    engine = trainer + 1e-7 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    engine[5, 17] += 1.7e-2
    p = logprob_parity(trainer, engine, torch.ones(64, 128))
    assert p.max_abs_diff == pytest.approx(1.7e-2, rel=1e-3) and p.p99_abs_diff < 1e-6
    assert parity_problem(p, 1e-3) is None


def test_a_stale_weight_moves_most_tokens_and_is_judged():
    g = torch.Generator().manual_seed(1)
    trainer = -torch.rand(64, 128, generator=g, dtype=torch.float64)
    engine = trainer + 0.05 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    problem = parity_problem(logprob_parity(trainer, engine, torch.ones(64, 128)), 1e-3)
    assert problem and "p99" in problem and "rollout.parity_p99_max=0.001" in problem


def test_the_limit_follows_the_engine_dtype_unless_set():
    from rlhf.schema import DType, RolloutConfig

    assert RolloutConfig().parity_limit == 1e-3  # fp32 engines: healthy p99 ~1e-5
    assert RolloutConfig(dtype=DType.bfloat16).parity_limit == 0.5  # bf16 rounding alone: 0.08-0.44 (tiny job)
    assert RolloutConfig(dtype=DType.bfloat16, parity_p99_max=0.05).parity_limit == 0.05


def test_a_run_computing_in_bf16_on_either_side_gets_the_bf16_limit():
    from pathlib import Path

    from rlhf.config import load_run_config
    from rlhf.parity import run_parity_limit

    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny_cpu.yaml"
    assert run_parity_limit(load_run_config(tiny)) == 1e-3
    assert run_parity_limit(load_run_config(tiny, ["trainer.compute_dtype=bfloat16"])) == 0.5
    assert run_parity_limit(load_run_config(tiny, ["trainer.compute_dtype=float32"])) == 1e-3
    assert run_parity_limit(load_run_config(tiny, ["rollout.dtype=bfloat16"])) == 0.5
    assert run_parity_limit(load_run_config(tiny, ["rollout.dtype=bfloat16", "trainer.compute_dtype=bfloat16"])) == 1.0
    assert run_parity_limit(load_run_config(tiny, ["trainer.compute_dtype=bfloat16", "rollout.parity_p99_max=0.2"])) == 0.2
