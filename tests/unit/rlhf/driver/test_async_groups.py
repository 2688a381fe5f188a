"""A batch's groups survive the trip through DistQueue and a checkpoint (JSON) unchanged: the step that
trains on them sees the same prompts, samples, behaviour logprobs, versions and rewards the producer made,
and the batch's statistics are counted once."""

import json
from dataclasses import replace

import torch

from actors.vllm.engine import Completion
from rlhf.data.prompts import PromptRow
from rlhf.data.versioned_queue import QueuedGroup
from rlhf.driver.stale_sync import to_groups, to_rollout
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
    assert first.verdicts == second.verdicts == {}
    import dataclasses

    coded = to_groups(dataclasses.replace(_rollout(), verdicts={"passed": 2, "error": 4}), batch=1, first_seq=0)
    coded = [QueuedGroup.from_json(json.loads(json.dumps(g.to_json()))) for g in coded]  # as a checkpoint keeps them
    assert to_rollout(coded[:1]).verdicts == {"passed": 2, "error": 4} and to_rollout(coded[1:]).verdicts == {}


def test_episodes_keep_their_loss_masks_and_agent_metrics_through_the_queue():
    """Multi-turn episodes under StaleSync: each sample's loss mask (observations 0) comes back as the producer
    made it, an old single completion's as none; a batch's agent/* metrics ride with its first group, and a
    step that takes two batches' first groups sums their counts and averages their shares."""
    from rlhf.driver.episodes import merge_agent_metrics

    ro = _rollout()
    masks = [(1, 0) if i % 2 else (1, 1) for i in range(len(ro.completions))]
    agent = {"agent/episodes_done": 0.5, "agent/token_mismatch": 0, "agent/sampled_tokens": 9,
             "agent/prefix_cache_hit_rate": 0.25}
    ro = replace(ro, completions=[replace(c, loss_mask=m) for c, m in zip(ro.completions, masks)], agent=agent)
    groups = [QueuedGroup.from_json(json.loads(json.dumps(g.to_json()))) for g in to_groups(ro, batch=2, first_seq=0)]
    back = to_rollout(groups)
    assert [c.loss_mask for c in back.completions] == masks and back.agent == agent
    assert to_rollout(groups[1:]).agent == {}  # the batch's metrics counted once, with its first group
    assert [c.loss_mask for c in to_rollout(to_groups(_rollout(), batch=1, first_seq=0)).completions] == [()] * 6
    other = to_groups(replace(ro, agent=agent | {"agent/episodes_done": 1.0, "agent/sampled_tokens": 3,
                                                 "agent/token_mismatch": 1}), batch=3, first_seq=3)
    both = to_rollout(groups[:1] + other[:1]).agent
    assert both == {"agent/episodes_done": 0.75, "agent/token_mismatch": 1, "agent/sampled_tokens": 12,
                    "agent/prefix_cache_hit_rate": 0.25}
    assert merge_agent_metrics([]) == {}


def test_route_references_round_trip_through_a_checkpoint(tmp_path):
    """Routing replay: each sample's RouteRef travels with it through the queue; a checkpoint writes the
    queue as JSON with block numbers, the blocks themselves handed to `save` (a Ray task in the run, so they
    never reach the driver) and read back by `load`; a queue saved before routes (five fields per sample)
    loads with none, one with routes inline (before blocks) is refused with what to do."""
    import pytest

    from rlhf.driver.stale_sync import ROUTE_BLOCKS, SAMPLE_FIELDS, queue_state_loaded, queue_state_saved
    from rlhf.moe.routing import RouteRef

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

    # each sample is saved by name; a checkpoint written before held it as a list of five (no routes) or six
    assert all(set(c) == set(SAMPLE_FIELDS) for g in saved["groups"] for c in g["payload"]["completions"])
    old = json.loads(json.dumps(saved))
    for g in old["groups"]:
        g["payload"]["completions"] = [[c[k] for k in SAMPLE_FIELDS[:5]] for c in g["payload"]["completions"]]
    five = to_rollout([QueuedGroup.from_json(g) for g in queue_state_loaded(old, tmp_path)["groups"]])
    assert all(c.routes is None for c in five.completions)
    assert [(c.token_ids, c.weight_version, c.token_versions) for c in five.completions] == \
        [(c.token_ids, c.weight_version, c.token_versions) for c in ro.completions]
    for g in old["groups"]:
        g["payload"]["completions"] = [c + [{"dtype": "|u1", "shape": [1, 1, 1], "base64": "AA=="}]
                                       for c in g["payload"]["completions"]]
    with pytest.raises(ValueError, match="routing_replay=off"):
        queue_state_loaded(old, tmp_path)


class _Run:
    """What the producer and `take_batch` read of a run (the loop's own bookkeeping, no roles)."""

    def __init__(self, steps: int, P: int, staleness: int):
        from types import SimpleNamespace

        from rlhf.schema import DataConfig, RunConfig, StaleSyncConfig

        self.cfg = RunConfig(steps=steps, data=DataConfig(prompts_per_step=P),
                             stale_sync=StaleSyncConfig(max_staleness=staleness))
        self.step, self.said = 0, []
        self.roles = self.route_stages = None
        self.inputs = SimpleNamespace(sampler=None, tokenizer=None)
        self.trace = SimpleNamespace(add=lambda *a: None)
        self.faults = SimpleNamespace(serve_recoveries=lambda: None, recovery_pending=lambda: False,
                                      producing=lambda batch: None)

    def log(self, line: str) -> None:
        self.said.append(line)


class _Queue:
    """DistQueue's interface over its in-process queue (one shard)."""

    def __init__(self):
        from rlhf.data.versioned_queue import VersionedQueue

        self.q = VersionedQueue()

    @property
    def dropped(self) -> int:
        return self.q.dropped

    def put(self, groups):
        self.q.put(groups)

    def take(self, n, step, max_staleness):
        return self.q.take(n, step, max_staleness)

    def size(self):
        return len(self.q)


def _three_steps(P: int, staleness: int):
    """Steps 1-3 taking their groups from a producer running `stale_sync.collect` (patched by the test), the
    engines serving each step's weights once it trained: the run, each step's (batch, seq) and the producer."""
    from rlhf.driver.stale_sync import Producer, take_batch

    run, queue = _Run(steps=3, P=P, staleness=staleness), _Queue()
    producer = Producer(run, queue, next_batch=1, next_seq=0).start()
    try:
        taken = []
        for step in (1, 2, 3):
            groups = take_batch(run, queue, producer, step)
            taken.append([(g.batch, g.seq) for g in groups])
            producer.serve(step)
    finally:
        producer.stop(10)
    return run, taken, producer


def test_a_batch_short_of_its_groups_is_made_up_by_one_more(monkeypatch):
    """Dynamic sampling can run out of draws with fewer groups than a step needs: the queue then holds fewer
    groups than the steps will take, so once every batch is made and a step is still short, the producer
    makes one more batch (it used to stop the run: "the trainer's batch is still short")."""
    from rlhf.driver import stale_sync

    P, sizes = 3, {1: 3, 2: 2, 3: 3, 4: 3}  # batch 2 comes back one group short

    def collect(cfg, roles, sampler, tok, b, route_stages=None, turn=None):
        ro = _rollout(P=sizes[b])
        return replace(ro, completions=[replace(c, weight_version=0, token_versions=(0, 0)) for c in ro.completions])

    monkeypatch.setattr(stale_sync, "collect", collect)
    run, taken, producer = _three_steps(P, staleness=2)
    assert taken == [[(1, 0), (1, 1), (1, 2)], [(2, 3), (2, 4), (3, 5)], [(3, 6), (3, 7), (4, 8)]]
    assert producer.last_batch == 4 and any("making one more" in line for line in run.said)


def test_a_step_the_bound_leaves_short_trains_on_the_groups_there(monkeypatch):
    """Each step makes up for short batches with groups of later ones; where the staleness bound holds back the
    batch that would make up this step's, the step trains on the groups there (as the synchronous loop trains on
    a short batch). It used to wait for a batch that waited for it: `make run` stalled at step 347 of 350."""
    from rlhf.driver import stale_sync

    P, s, sizes = 3, 1, {1: 1, 2: 1, 3: 3, 4: 3}  # batches 1 and 2 come back short: step 1 has 2 groups of 3

    def collect(cfg, roles, sampler, tok, b, route_stages=None, turn=None):
        ro = _rollout(P=sizes[b])
        v = max(0, b - 1 - s)  # the oldest weights may_start lets batch b be made with
        return replace(ro, completions=[replace(c, weight_version=v, token_versions=(v, v)) for c in ro.completions])

    monkeypatch.setattr(stale_sync, "collect", collect)
    run, taken, _ = _three_steps(P, staleness=s)
    assert taken == [[(1, 0), (2, 1)], [(3, 2), (3, 3), (3, 4)], [(4, 5), (4, 6), (4, 7)]]
    assert sum("training on them" in line for line in run.said) == 1, run.said
