import random

import pytest

from rlhf.micro_batches import balance, padded_cost


@pytest.mark.parametrize("lengths, dp, max_tokens", [
    ([10] * 8, 2, 40),
    ([100, 5, 5, 5, 5, 5, 5, 90], 2, 200),
    ([300, 10, 10, 10], 2, 100),  # one sample over budget gets its own micro-batch
    (list(range(1, 33)), 4, 64),
])
def test_every_sample_once_equal_counts_budget_kept(lengths, dp, max_tokens):
    b = balance(lengths, dp, max_tokens)
    flat = sorted(i for rank in b.per_rank for mb in rank for i in mb)
    assert flat == list(range(len(lengths)))
    assert len({len(rank) for rank in b.per_rank}) == 1
    for rank in b.per_rank:
        for mb in rank:
            assert padded_cost(mb, lengths) <= max_tokens or len(mb) == 1


def test_token_balance_beats_round_robin_on_skewed_lengths():
    rng = random.Random(0)
    lengths = [rng.choice([8, 16, 512]) for _ in range(64)]
    b = balance(lengths, 4, 2048)
    rr = [sum(lengths[i::4]) for i in range(4)]
    assert b.imbalance <= 1.05 < max(rr) / (sum(rr) / 4)


def test_clear_errors():
    with pytest.raises(ValueError, match="cannot feed 4"):
        balance([5, 5], 4, 100)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        balance([100, 100, 1], 2, 100)


def test_cost_balance_counts_the_attention_term_and_beats_token_balance_and_index_order():
    """One long sample among short ones: balanced by tokens, its rank also has the long sample's quadratic
    attention; balanced by predicted cost (tokens plus the attention term), the ranks' work is even."""
    from rlhf.micro_batches import by_index_imbalance, sample_cost

    q = 0.002
    lengths = [512] + [128] * 12
    by_tokens, by_cost = balance(lengths, 2, 4096), balance(lengths, 2, 4096, quadratic=q)
    assert by_tokens.imbalance == 1.0  # 1024 tokens each
    tokens_cost = [sum(sample_cost(lengths[i], q) for mb in rank for i in mb) for rank in by_tokens.per_rank]
    assert by_cost.cost_per_rank == pytest.approx(
        [sum(sample_cost(lengths[i], q) for mb in rank for i in mb) for rank in by_cost.per_rank])
    assert by_cost.cost_imbalance < 1.03 < 1.1 < max(tokens_cost) / (sum(tokens_cost) / 2)
    assert by_index_imbalance(lengths, 2, q) > by_cost.cost_imbalance
    assert balance(lengths, 2, 4096, quadratic=0.0) == by_tokens  # 0: by tokens alone, as before


def test_attention_quadratic_is_the_models_flops_ratio():
    """sample_cost(L, q) * 2 * active equals the simulator's forward FLOPs of one causal sequence of L tokens."""
    from pathlib import Path

    from rlhf.micro_batches import sample_cost
    from rlhf.config import load_model_config
    from rlhf.sim.workload import attention_quadratic, model_cost

    models = Path(__file__).resolve().parents[3] / "configs" / "model"
    for name in ("qwen3_moe_tiny", "pangu_moe_tiny", "qwen3_moe_small"):
        m = load_model_config(models / f"{name}.yaml")
        q, c = attention_quadratic(m), model_cost(m)
        assert q > 0
        for L in (16, 300):
            assert sample_cost(L, q) * 2 * c.active == pytest.approx(c.forward_flops(L, L / 2))
