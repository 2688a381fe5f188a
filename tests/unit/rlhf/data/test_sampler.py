"""PromptSampler: deterministic for a seed, and a resumed sampler draws what the uninterrupted one does."""

import pytest

from rlhf.data.sampler import PromptSampler


def test_resumed_sampler_continues_the_same_sequence_across_epochs():
    rows = list(range(10))
    a = PromptSampler(rows, 4, seed=3)
    straight = [a.next() for _ in range(6)]  # crosses two epoch boundaries
    b = PromptSampler(rows, 4, seed=3)
    first = [b.next() for _ in range(2)]
    state = b.state_dict()
    c = PromptSampler(rows, 4, seed=3)
    c.load_state_dict(state)
    assert first + [c.next() for _ in range(4)] == straight
    assert sorted(straight[0] + straight[1] + straight[2][:2]) == rows  # an epoch is a permutation


def test_resume_with_another_seed_is_refused():
    s = PromptSampler([1, 2, 3], 2, seed=0)
    with pytest.raises(ValueError, match="resume with seed=0"):
        PromptSampler([1, 2, 3], 2, seed=1).load_state_dict(s.state_dict())
