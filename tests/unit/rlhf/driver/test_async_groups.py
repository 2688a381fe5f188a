"""A batch's groups survive the trip through DistQueue and a checkpoint (JSON) unchanged: the step that
trains on them sees the same prompts, samples, behaviour logprobs, versions and rewards the producer made,
and the batch's statistics are counted once."""

import json

import torch

from actors.vllm_engine import Completion
from rlhf.data.prompts import PromptRow
from rlhf.data.versioned_queue import QueuedGroup
from rlhf.driver.async_loop import to_groups, to_rollout
from rlhf.driver.rollout import Rollout


def _rollout(P=3, G=2):
    rows = [PromptRow(f"{i}+1=", str(i + 1), f"train.jsonl:{i}") for i in range(P)]
    comps = [Completion(i // G, (5 + i, 2), (-0.25 * i, -0.5), "stop", 7 + i % 2, (7 + i % 2, 8))
             for i in range(P * G)]
    return Rollout(rows, [[1, 4 + i] for i in range(P)], comps, torch.arange(P * G, dtype=torch.float32).view(P, G),
                   torch.ones(P, G), groups_drawn=5, generate_seconds=1.5, reward_seconds=0.25, generated_tokens=12)


def test_groups_round_trip_through_json():
    ro = _rollout()
    groups = [QueuedGroup.from_json(json.loads(json.dumps(g.to_json()))) for g in to_groups(ro, batch=4, first_seq=30)]
    assert [g.seq for g in groups] == [30, 31, 32] and {g.batch for g in groups} == {4}
    assert [g.version for g in groups] == [7, 7, 7]  # the oldest weights among each group's samples
    back = to_rollout(groups)
    assert back.rows == ro.rows and back.prompt_ids == ro.prompt_ids
    assert [(c.token_ids, c.logp, c.finish_reason, c.weight_version, c.token_versions) for c in back.completions] == \
        [(c.token_ids, c.logp, c.finish_reason, c.weight_version, c.token_versions) for c in ro.completions]
    assert torch.equal(back.rewards_PG, ro.rewards_PG) and torch.equal(back.scores_PG, ro.scores_PG)
    assert (back.groups_drawn, back.generate_seconds, back.reward_seconds, back.generated_tokens) == (5, 1.5, 0.25, 12)


def test_a_batch_split_over_two_steps_counts_its_statistics_once():
    groups = to_groups(_rollout(), batch=1, first_seq=0)
    first, second = to_rollout(groups[:2]), to_rollout(groups[2:])
    assert first.generated_tokens + second.generated_tokens == 12
    assert first.groups_drawn + second.groups_drawn == 5


def test_routes_round_trip_and_older_checkpoints_still_load():
    """Routing replay: each sample's engine routes travel with it through the queue and a checkpoint; a
    queue saved before routes existed (five fields per sample) loads with none."""
    from dataclasses import replace

    import numpy as np

    ro = _rollout()
    routes = [np.arange(3 * 2 * 4, dtype=np.uint8).reshape(3, 2, 4) + i for i in range(len(ro.completions))]
    ro = replace(ro, completions=[replace(c, routes=r) for c, r in zip(ro.completions, routes)])
    groups = [QueuedGroup.from_json(json.loads(json.dumps(g.to_json()))) for g in to_groups(ro, batch=4, first_seq=0)]
    back = to_rollout(groups)
    assert all(c.routes.dtype == np.uint8 and np.array_equal(c.routes, r) for c, r in zip(back.completions, routes))
    for g in groups:
        g.payload["completions"] = [c[:5] for c in g.payload["completions"]]
    assert all(c.routes is None for c in to_rollout(groups).completions)
