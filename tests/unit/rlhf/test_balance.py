import random

import pytest

from rlhf.balance import balance, padded_cost


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
