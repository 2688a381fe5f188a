"""A batch's groups survive the trip through DistQueue and a checkpoint (JSON) unchanged: the step that
trains on them sees the same prompts, samples, behaviour logprobs, versions and rewards the producer made,
and the batch's statistics are counted once."""

import json
from dataclasses import replace

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


def test_route_references_round_trip_through_a_checkpoint(tmp_path):
    """Routing replay: each sample's RouteRef travels with it through the queue; a checkpoint writes the
    queue as JSON with block numbers, the blocks themselves handed to `save` (a Ray task in the run, so they
    never reach the driver) and read back by `load`; a queue saved before routes (five fields per sample)
    loads with none, one with routes inline (before blocks) is refused with what to do."""
    import pytest

    from rlhf.driver.async_loop import ROUTE_BLOCKS, queue_state_loaded, queue_state_saved
    from rlhf.routing import RouteRef

    ro = _rollout()
    refs = [RouteRef(3 * i, 3, ("call0-stage0" if i < 4 else "call1-stage0", "call0-stage1" if i < 4 else "call1-stage1"))
            for i in range(len(ro.completions))]
    ro = replace(ro, completions=[replace(c, routes=r) for c, r in zip(ro.completions, refs)])
    state = {"groups": [g.to_json() for g in to_groups(ro, batch=4, first_seq=0)], "dropped": 1}
    written = {}
    saved = json.loads(json.dumps(queue_state_saved(state, tmp_path, lambda path, bs: written.update({path: bs}))))
    assert list(written) == [tmp_path / ROUTE_BLOCKS] and len(written[tmp_path / ROUTE_BLOCKS]) == 4
    order = written[tmp_path / ROUTE_BLOCKS]

    def load(path, n):
        assert path == tmp_path / ROUTE_BLOCKS and n == 4
        return [f"reloaded {b}" for b in order]

    back = to_rollout([QueuedGroup.from_json(g) for g in queue_state_loaded(saved, tmp_path, load)["groups"]])
    assert [(c.routes.start, c.routes.positions) for c in back.completions] == [(r.start, r.positions) for r in refs]
    assert [c.routes.blocks for c in back.completions] == [tuple(f"reloaded {b}" for b in r.blocks) for r in refs]
    assert queue_state_loaded(saved, tmp_path, load)["dropped"] == 1

    old = json.loads(json.dumps(saved))
    for g in old["groups"]:
        g["payload"]["completions"] = [c[:5] for c in g["payload"]["completions"]]
    assert all(c.routes is None for c in to_rollout([QueuedGroup.from_json(g) for g in
                                                     queue_state_loaded(old, tmp_path)["groups"]]).completions)
    for g in old["groups"]:
        g["payload"]["completions"] = [c + [{"dtype": "|u1", "shape": [1, 1, 1], "base64": "AA=="}]
                                       for c in g["payload"]["completions"]]
    with pytest.raises(ValueError, match="routing_replay=off"):
        queue_state_loaded(old, tmp_path)
