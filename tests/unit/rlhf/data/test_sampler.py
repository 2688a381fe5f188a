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


def test_prompt_seeds_give_every_prompt_and_call_its_own_streams():
    from rlhf.data.sampler import prompt_seed

    n = 16  # samples per prompt: prompt seeded s draws from s .. s + n - 1
    seeds = [prompt_seed(base, i) for base in range(50) for i in range(64)]
    assert seeds == [prompt_seed(base, i) for base in range(50) for i in range(64)]  # deterministic
    assert all(0 <= s < 2**62 for s in seeds)
    streams = [s + k for s in seeds for k in range(n)]
    assert len(set(streams)) == len(streams)  # no two (call, prompt, sample) share a random stream
