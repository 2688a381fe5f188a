"""StaleSync (`stale_sync.max_staleness` > 0): a rollout source (`rlhf.driver.sources`) whose engines
generate the next batches while the trainer trains on this one, within the staleness bound, over DistQueue.

    producer thread   batch b: wait until the engines serve version b - 1 - max_staleness (the bound and
                      the back-pressure: `rlhf.algorithms.staleness.may_start`), draw prompts, generate,
                      score, dynamic sampling (`rollout.collect`, seeds keyed by b as in the synchronous
                      loop), push the batch's groups to the queue, each with the weight version that made it
    trainer (the      step t: take the t-th batch's groups from the queue (oldest first, never one beyond the
    loop's thread)    bound: older ones are dropped and counted), then the loop's step as with any source:
                      old logprobs, update, weight sync (`step.learn`)

On devices the engines and the trainer share, awake engines (`rollout.sleep_level: 0`) generate beside the
trainer as on devices of their own; engines that sleep while the trainer works take turns with it
(`rlhf.driver.turns`): the producer holds the devices while its engines generate, the trainer from switching
to training to switching back (as the synchronous loop switches), and reward scoring, dynamic sampling and
the driver's work overlap the other side's turn.

The producer and the sync meet at the engine actors, which run one call at a time: a sync issued while an
engine generates waits for that generation to finish (its requests finish on the version they started
with), then installs; the engine's next generation runs on the new version and says so in every sample
(`Completion.weight_version`). No engine serves a half-installed version (the sync is exact and checksummed
as in the synchronous loop).

The loss weights every token by min(pi_proximal / pi_behaviour, algorithm.tis_cap) (decoupled PPO, Hilton et
al. 2022; `rlhf.algorithms.objective`): pi_proximal is the trainer's policy at the start of the update,
pi_behaviour the engine's logprobs of the weights that sampled. Trainer/engine parity is checked on the
samples of the weights the step starts from (there the two must agree), the staleness distribution and the
importance weights' spread are logged every step (`stale/*`). A checkpoint pauses the producer between
batches and saves the queue beside the data cursor: a resumed run trains on every made group once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, ContextManager

import torch

from actors.dist_queue import DistQueue
from actors.remote import RoleError
from actors.route_blocks import load_route_blocks, save_route_blocks
from actors.vllm.engine import Completion
from rlhf.algorithms.correction import correction_stats
from rlhf.algorithms.staleness import importance_stats, may_start, staleness_stats
from rlhf.checkpoint import load_driver_state
from rlhf.data.prompts import PromptRow
from rlhf.data.versioned_queue import QueuedGroup
from rlhf.driver.episodes import merge_agent_metrics
from rlhf.driver.rollout import Rollout, collect
from rlhf.driver.turns import DeviceTurns
from rlhf.parity import Parity, logprob_parity
from rlhf.moe.routing import RouteRef
from rlhf.schema import RunConfig

WAIT_POLL_S = 5.0  # how often a waiting thread re-checks that its peer is alive


class ProducerError(RuntimeError):
    """The rollout producer failed; the cause names the role and rank that did (a RoleError)."""


class _Stopping(Exception):
    """The producer was stopped while it waited for the devices' turn."""


def device_turns(run) -> DeviceTurns | None:
    """Turns for engines that share devices with the trainer and sleep while it works; None where the two
    can compute at once (devices of their own, or awake engines: `rollout.sleep_level` 0)."""
    shared = run.inputs.device_map.shared("trainer", "rollout")
    if not shared or not run.cfg.rollout.sleep_level:
        return None
    trace = run.trace  # each turn on a row of its own: "devices/turns"
    return DeviceTurns(WAIT_POLL_S, on_turn=lambda side, t0, dt: trace.add(f"{side} turn", "devices/turns", t0, dt,
                                                                            run.at_step))


class Producer:
    """Makes batches on a thread of its own, ahead of the trainer within the bound."""

    def __init__(self, run, queue: DistQueue, next_batch: int, next_seq: int, turns: DeviceTurns | None = None):
        self.run, self.queue, self.turns = run, queue, turns
        # the reference scores each batch as soon as it is made, beside the trainer's step; taking turns, it
        # stays in the trainer's turn (it shares the devices)
        self.reference_ahead = bool(run.roles and run.roles.reference) and turns is None
        self.cond = threading.Condition()
        self.served = run.step  # the version every engine serves
        self.next_batch, self.next_seq = next_batch, next_seq
        self.last_batch = run.cfg.steps  # raised by one for each batch's worth of groups dropped
        self.groups_made = 0
        self.paused = self.busy = self.stopping = False
        self.error: BaseException | None = None
        self.wait_seconds = 0.0  # held back by the bound, since the trainer last read it
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> "Producer":
        self.thread.start()
        return self

    def _blocked(self) -> bool:
        s = self.run.cfg.stale_sync.max_staleness
        return self.paused or self.next_batch > self.last_batch or not may_start(self.next_batch, self.served, s)

    def _run(self) -> None:
        run, cfg = self.run, self.run.cfg
        try:
            while True:
                with self.cond:
                    t0 = time.time()
                    while not self.stopping and self._blocked():
                        self.cond.wait()
                    self.wait_seconds += time.time() - t0
                    if self.stopping:
                        return
                    b, self.busy = self.next_batch, True
                run.faults.producing(b)  # where chaos kills of its generation land
                t0 = time.time()
                ro = collect(cfg, run.roles, run.inputs.sampler, run.inputs.tokenizer, b, run.route_stages,
                             turn=self._turn)
                run.trace.add("rollout", "driver/producer", t0, time.time() - t0, b)
                if self.reference_ahead:
                    ro = self._with_reference(ro, b)
                groups = to_groups(ro, b, self.next_seq)
                self.queue.put(groups)
                with self.cond:
                    self.next_batch, self.next_seq = b + 1, self.next_seq + len(groups)
                    self.groups_made += len(groups)
                    self.busy = False
                    self.cond.notify_all()
        except _Stopping:
            with self.cond:
                self.busy = False
                self.cond.notify_all()
        except BaseException as e:  # reported to the trainer's thread, which raises it
            with self.cond:
                self.error, self.busy = e, False
                self.cond.notify_all()

    def _with_reference(self, ro: Rollout, b: int) -> Rollout:
        """Batch b with its reference logprobs. A reference rank that fails here leaves them to the step that
        trains on the batch, where the failure takes the trainer's restart path (`Run.dead_policy_rank`)."""
        run = self.run
        batch, t0 = run.token_batch(ro), time.time()
        try:
            ref_BT = run.reference_logprobs(batch, b, timed=False)
        except RoleError as e:
            run.log(f"batch {b}: reference logprobs left to the step: {e}")
            return ro
        run.trace.add("reference logprobs", "driver/producer", t0, time.time() - t0, b)
        return replace(ro, ref_logp=batch.response_rows(ref_BT))

    def _turn(self):
        return self.turns.hold("rollout", self._poll) if self.turns else nullcontext()

    def _poll(self) -> None:
        if self.stopping:
            raise _Stopping

    def check(self) -> None:
        if self.error is not None:
            raise ProducerError(f"the rollout producer failed: {self.error}") from self.error

    def wait(self, until: Callable[[], bool]) -> None:
        """Block until `until()` (read under the lock) or the producer fails; meanwhile replace the engines the
        producer found dead (the trainer is idle here), or it would wait for us as we wait for it."""
        while True:
            self.run.faults.serve_recoveries()
            with self.cond:
                self.check()
                if until():
                    return
                done = self.next_batch > self.last_batch and not self.busy  # nothing left to make
                if done or not self.thread.is_alive():
                    raise ProducerError(f"the rollout producer made every batch up to {self.last_batch} and the "
                                        "trainer's batch is still short")
                if not self.run.faults.recovery_pending():
                    self.cond.wait(WAIT_POLL_S)

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def serve(self, version: int) -> None:
        """The engines serve `version` now: batches waiting for it may start."""
        with self.cond:
            self.served = version
            self.cond.notify_all()

    def take_wait_seconds(self) -> float:
        with self.cond:
            w, self.wait_seconds = self.wait_seconds, 0.0
            return w

    @contextmanager
    def paused_between_batches(self):
        """The producer idle (its batch in flight finished and queued) for as long as the block runs."""
        with self.cond:
            self.paused = True
        while True:  # an engine the batch in flight found dead is replaced here, or the batch never finishes
            self.run.faults.serve_recoveries()
            with self.cond:
                if not self.busy or self.error is not None:
                    self.check()
                    break
                if not self.run.faults.recovery_pending():
                    self.cond.wait(WAIT_POLL_S)
        try:
            yield
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def stop(self, timeout_s: float) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout_s)


# A queued sample, JSON-able (in DistQueue and in a checkpoint's queue): its named fields. A checkpoint written
# before they were named holds a list of them in this order, the later ones missing where it predates them.
# loss_mask: an episode's (1 sampled, 0 observation; `rlhf.driver.episodes`), empty for a single completion.
SAMPLE_FIELDS = ("token_ids", "logp", "finish_reason", "weight_version", "token_versions", "routes", "loss_mask")


def sample_fields(c: dict | list) -> dict:
    """A queued sample as its named fields, whichever form the queue or checkpoint holds."""
    return c if isinstance(c, dict) else dict(zip(SAMPLE_FIELDS, list(c) + [None] * (len(SAMPLE_FIELDS) - len(c))))


def to_groups(ro: Rollout, batch: int, first_seq: int) -> list[QueuedGroup]:
    """A batch's groups as queue entries (payloads JSON-able but for each sample's `RouteRef`, which
    `queue_state_saved` turns into JSON). The batch's own statistics ride on its first group, so they are
    counted once, at the step that trains on that group."""
    G = len(ro.completions) // len(ro.rows)
    stats = {"drawn": ro.groups_drawn, "generate_seconds": ro.generate_seconds,
             "reward_seconds": ro.reward_seconds, "tokens": ro.generated_tokens, "stopped": ro.groups_stopped,
             "verdicts": ro.verdicts, "agent": ro.agent}
    out = []
    for i, row in enumerate(ro.rows):
        comps = ro.completions[i * G:(i + 1) * G]
        payload = {"row": [row.prompt, row.answer, row.source], "prompt_ids": list(ro.prompt_ids[i]),
                   "completions": [{"token_ids": list(c.token_ids), "logp": list(c.logp),
                                    "finish_reason": c.finish_reason, "weight_version": c.weight_version,
                                    "token_versions": list(c.token_versions), "routes": c.routes,
                                    "loss_mask": list(c.loss_mask)} for c in comps],
                   "rewards": ro.rewards_PG[i].tolist(), "scores": ro.scores_PG[i].tolist(),
                   "batch_stats": stats if i == 0 else None}
        if ro.ref_logp is not None:
            payload["ref_logp"] = ro.ref_logp[i * G:(i + 1) * G]
        out.append(QueuedGroup(first_seq + i, batch, min(c.weight_version for c in comps), payload))
    return out


ROUTE_BLOCKS = "queue_routes.safetensors"  # in a StaleSync checkpoint: the route blocks of queued samples


def _with_samples(state: dict, f: Callable[[dict], dict]) -> dict:
    """The queue's state with `f` applied to each sample's named fields."""
    return state | {"groups": [g | {"payload": g["payload"] | {"completions": [f(sample_fields(c)) for c in
                                                                               g["payload"]["completions"]]}}
                               for g in state["groups"]]}


def queue_state_saved(state: dict, d: Path, save: Callable | None = None) -> dict:
    """The queue's state (`DistQueue.state`) for a checkpoint in `d`, JSON-able: each sample's routes
    (a `RouteRef`) as its rows and block numbers, the blocks written to d/ROUTE_BLOCKS by `save(path, refs)`
    (`actors.route_blocks.save_route_blocks`: a task reads them, the driver never holds them)."""
    blocks: dict = {}

    def out(c: dict) -> dict:
        r = c["routes"]
        return c if r is None else c | {"routes": {
            "start": r.start, "positions": r.positions, "itemsize": r.itemsize,
            "blocks": [blocks.setdefault(b, len(blocks)) for b in r.blocks]}}

    saved = _with_samples(state, out)
    if blocks:
        (save or save_route_blocks)(d / ROUTE_BLOCKS, list(blocks))
    return saved


def queue_state_loaded(state: dict, d: Path, load: Callable | None = None) -> dict:
    """`queue_state_saved` undone: the routes of queued samples as `RouteRef`s to blocks read back into the
    object store by `load(path, n)` (`actors.route_blocks.load_route_blocks`)."""
    saved = [r for g in state["groups"] for c in g["payload"]["completions"] if (r := sample_fields(c)["routes"])]
    if any("blocks" not in r for r in saved):
        raise ValueError(f"checkpoint {d} holds queued routes inline (written before route blocks); resume it "
                         "with rollout.capture_routes=false trainer.routing_replay=off, or start the run afresh")
    n = max((i + 1 for r in saved for i in r["blocks"]), default=0)
    refs = (load or load_route_blocks)(d / ROUTE_BLOCKS, n) if n else []

    def back(c: dict) -> dict:
        r = c["routes"]
        return c if r is None else c | {"routes": RouteRef(r["start"], r["positions"],
                                                           tuple(refs[i] for i in r["blocks"]), r["itemsize"])}

    return _with_samples(state, back)


def to_rollout(groups: list[QueuedGroup]) -> Rollout:
    """A step's rollouts from the groups it took."""
    rows, prompt_ids, comps = [], [], []
    drawn = gen_s = rew_s = tokens = stopped = 0
    verdicts: Counter = Counter()
    agent: list[dict] = []  # the agent/* metrics of each batch whose statistics the step takes
    for p, g in enumerate(groups):
        d = g.payload
        rows.append(PromptRow(*d["row"]))
        prompt_ids.append(d["prompt_ids"])
        for c in map(sample_fields, d["completions"]):
            comps.append(Completion(p, tuple(c["token_ids"]), tuple(c["logp"]), c["finish_reason"],
                                    c["weight_version"], tuple(c["token_versions"]), c["routes"],
                                    tuple(c["loss_mask"] or ())))
        if d["batch_stats"]:
            s = d["batch_stats"]
            drawn, gen_s = drawn + s["drawn"], gen_s + s["generate_seconds"]
            rew_s, tokens = rew_s + s["reward_seconds"], tokens + s["tokens"]
            stopped += s.get("stopped", 0)  # none in checkpoints written before streamed rollouts
            verdicts.update(s.get("verdicts", {}))
            agent += [s["agent"]] if s.get("agent") else []
    ref = [g.payload.get("ref_logp") for g in groups]  # none in checkpoints written before it
    return Rollout(rows, prompt_ids, comps, torch.tensor([g.payload["rewards"] for g in groups]),
                   torch.tensor([g.payload["scores"] for g in groups]), drawn, gen_s, rew_s, tokens, stopped,
                   [r for rs in ref for r in rs] if all(r is not None for r in ref) else None, dict(verdicts),
                   merge_agent_metrics(agent))


def take_batch(run, queue: DistQueue, producer: Producer, step: int) -> list[QueuedGroup]:
    """Step `step`'s groups, oldest first, waiting for the producer while the queue holds too few."""
    P, s = run.cfg.data.prompts_per_step, run.cfg.stale_sync.max_staleness
    have: list[QueuedGroup] = []
    while True:
        with producer.cond:
            made = producer.groups_made
        got, dropped = queue.take(P - len(have), step, s)
        have += got
        if dropped:  # groups too old to train on: one more batch's worth made for each batch dropped
            with producer.cond:
                producer.last_batch += -(-dropped // P)
                producer.cond.notify_all()
            run.log(f"step {step}: dropped {dropped} group(s) older than stale_sync.max_staleness={s}")
        if len(have) == P:
            return have
        with producer.cond:  # none made since the take, none in the making, the step still short: batches came
            idle = producer.groups_made == made and not producer.busy  # back short (dynamic sampling out of draws)
            short = idle and producer.next_batch > producer.last_batch  # every batch made: one more makes them up
            if short:
                producer.last_batch += 1
                producer.cond.notify_all()
            # the next batch waits for this step to train (the staleness bound): each step before took groups of
            # later batches to make up for short ones, and this one cannot; it trains on what there is, as the
            # synchronous loop trains on a short batch (waiting here stalled the run)
            bounded = idle and not short and not may_start(producer.next_batch, producer.served, s)
        if short:
            run.log(f"step {step}: {len(have)} of {P} groups queued and every batch made (one came back short "
                    "of its groups): making one more")
        elif bounded and have:
            run.log(f"step {step}: {len(have)} of {P} groups queued and the next batch waits for this step "
                    f"(stale_sync.max_staleness={s}; batches came back short of their groups): training on them")
            return have
        producer.wait(lambda: producer.groups_made > made)


def producer_from(run, queue: DistQueue, ckpt: Path | None, turns: DeviceTurns | None = None) -> Producer:
    """A producer (not started) going on from checkpoint `ckpt` (None: from the run's step, nothing queued):
    a StaleSync checkpoint's queued groups are loaded to be trained on, not made again, and batches are made
    from its cursor."""
    next_batch, next_seq = run.step + 1, 0
    state = load_driver_state(ckpt).get("stale_sync") if ckpt is not None else None
    queue.load(queue_state_loaded(state["queue"], ckpt) if state else {"groups": [], "dropped": 0})
    if state:
        next_batch, next_seq = state["next_batch"], state["next_seq"]
        run.log(f"resumed {len(state['queue']['groups'])} queued group(s); producing from batch {next_batch}")
    return Producer(run, queue, next_batch, next_seq, turns)


class StaleSync:
    """The StaleSync rollout source: a `Producer` thread ahead of the trainer within the bound, its batches'
    groups in a `DistQueue` (both this source's), the devices' turns where the two share devices."""

    phase = "wait for rollouts"

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.queue: DistQueue | None = None
        self.producer: Producer | None = None
        self.turns: DeviceTurns | None = None
        self.groups: list[QueuedGroup] = []  # the step's, as taken from the queue

    @property
    def switches(self) -> bool:
        """Engines that sleep while the trainer works switch in the training turn, as the synchronous loop."""
        return self.turns is not None

    def wake(self) -> None:
        if self.producer is not None:
            self.producer.notify()

    def start(self, run) -> None:
        """A producer going on from the run's last checkpoint (a trainer restart) or the one it resumed from."""
        if self.queue is None:
            self.queue = DistQueue(self.cfg.stale_sync.queue_shards, timeout_s=run.roles.timeout_s)
            self.turns = device_turns(run)
        self.producer = producer_from(run, self.queue, run.last_checkpoint or run.inputs.resume_dir, self.turns)
        self.producer.start()

    def batch(self, run, step: int) -> Rollout:
        self.groups = take_batch(run, self.queue, self.producer, step)
        return to_rollout(self.groups)

    def turn(self, run, step: int) -> ContextManager:
        """The devices' turn: engines asleep and the trainer onloaded in it, as the synchronous loop switches."""
        if self.turns is None:
            return nullcontext()
        return self.turns.hold("training", lambda: (run.faults.serve_recoveries(), self.producer.check()))

    def trained(self, run, step: int) -> None:
        run.faults.serve_recoveries()  # the engines the producer found dead get version `step` with the others
        self.producer.serve(step)

    def quiet(self) -> ContextManager:
        return self.producer.paused_between_batches()

    def state(self, d: Path) -> dict:
        p = self.producer
        return {"stale_sync": {"queue": queue_state_saved(self.queue.state(), d), "next_batch": p.next_batch,
                               "next_seq": p.next_seq}}

    def measure(self, run, step: int, ro: Rollout, learned) -> tuple[Parity, dict]:
        """Parity on the samples of the weights the step starts from (only there must trainer and engines agree);
        the staleness, the importance weights' spread, the queue, and the waits."""
        batch, groups = learned.batch, self.groups
        versions = [c.weight_version for c in ro.completions]
        fresh = torch.tensor([v == step - 1 for v in versions]).unsqueeze(1)
        parity = logprob_parity(learned.old_logp, batch.rollout_logp_BT, batch.mask_BT * fresh.to(batch.mask_BT.dtype))
        extra = staleness_stats(step, versions) | importance_stats(
            learned.old_logp, batch.rollout_logp_BT, batch.mask_BT, self.cfg.algorithm.tis_cap) | correction_stats(
            self.cfg.algorithm, learned.old_logp, batch.rollout_logp_BT, batch.mask_BT)
        # an episode's observation tokens carry version -1: not a version of its own
        extra |= {"stale/mixed_version_samples": sum(len(set(c.token_versions) - {-1}) > 1 for c in ro.completions),
                  "stale/seq_first": groups[0].seq, "stale/seq_last": groups[-1].seq,
                  "stale/queue_groups": self.queue.size(), "stale/samples_dropped": self.samples_dropped,
                  "stale/producer_wait_seconds": self.producer.take_wait_seconds()}
        if self.turns is not None:  # how long each side waited for the devices since the last step
            waited = self.turns.take_wait_seconds()
            extra |= {f"stale/turn_wait_seconds_{side}": round(waited.get(side, 0.0), 3)
                      for side in ("rollout", "training")}
        return parity, extra

    @property
    def samples_dropped(self) -> int:
        """Samples too old to train on (the queue counts, and saves, the groups)."""
        return (self.queue.dropped if self.queue is not None else 0) * self.cfg.algorithm.group_size

    def stop(self, timeout_s: float, restarting: BaseException | None = None) -> None:
        """`restarting`: the trainer restarts after it, and a producer still running past `timeout_s` (its batch
        in flight never ends) raises: the engines would not be idle."""
        if self.producer is None:
            return
        self.producer.stop(timeout_s)
        if restarting is not None and self.producer.thread.is_alive():
            raise ProducerError(f"the rollout producer did not stop within {timeout_s:.0f} s to restart the trainer "
                                f"after: {restarting}") from restarting

    def result(self) -> dict:
        return {"samples_dropped": self.samples_dropped}

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None
