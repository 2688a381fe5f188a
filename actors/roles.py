"""A run's roles on Ray: started where the placement says, wired into their groups, and the fan-out
calls the driver makes on each (every call deadline-bound; a failure names role and rank).

  trainer     `TrainerWorker` x (pp * dp * tp), one torch.distributed group
  reference   `PolicyWorker` x the same layout, its own group (only when the KL term needs it)
  rollout     `VLLMEngine` x num_engines
  reward      `RuleRewardWorker` (rule verifiers) or `RewardModelWorker` (kind: model) x reward.workers
  environment `EnvironmentWorker` x agent.workers (agent runs, which have no reward workers)
  weight sync trainer ranks + engine hosts in one point-to-point group (`weight_sync.group`)

Each device is a bundle of a per-node STRICT_PACK placement group; a role rank asks for its device's
bundle and a share of it (`rlhf.placement.actor_options`), so co-located roles fit together.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from actors.remote import RoleError, RoleHandle, call_all, call_each, spawn
from actors.replies import LogprobsReply, ScoreReply, SyncReplies
from actors.vllm.platform import SHUTDOWN_GRACE_S
from rlhf.data.sampler import prompt_seed
from rlhf.schema import DeviceType, RewardKind, RoutingReplay, RunConfig

RELEASE_TIMEOUT_S = 30.0  # a reward or environment worker letting go of its programs' processes and directories
START_TIMEOUT_S = 900.0  # vLLM start (30-40 s here; longer on a cold compile cache) and model loading


@dataclass
class Roles:
    trainer: list[RoleHandle]
    reference: list[RoleHandle]
    engines: list[RoleHandle]
    rewards: list[RoleHandle]
    placement_groups: list
    timeout_s: float
    environments: list[RoleHandle] = field(default_factory=list)  # agent runs' environment workers
    start_environment: Optional[Callable[[int], RoleHandle]] = None  # worker i on its placement slot
    environment_timeout_s: float = 10.0  # agent.step_timeout_s
    environment_pools: dict = field(default_factory=dict, repr=False)  # `environment_pool`'s, by stop strings
    # set by `start` (a Roles built by hand has no engines to replace)
    start_engine: Optional[Callable[..., RoleHandle]] = None  # engine k on its placement slot
    sync_layout: Any = None
    sync_backend: str = "gloo"
    sync_timeout_s: float = 120.0
    start_policy: Optional[Callable[..., tuple]] = None  # every trainer and reference rank on its slot
    engine_shm: list = field(default_factory=list)  # each engine's shared-memory prefixes
    shm_record: Optional[Path] = None  # where `engine_shm` is kept for the next driver of the run (`record_shm`)
    policy_pids: list = field(default_factory=list)  # the trainer and reference ranks' processes
    engine_pids: list = field(default_factory=list)  # each engine actor's process (chaos.stop_engines)
    hang_timeout_s: float = 0.0  # a generate call not answered within it: the engine hangs (0: timeout_s)
    version: int = 0  # the weights every engine serves (the last sync's)
    # the driver's (`start(recover=...)`): replaces dead engines (indices, what failed, the handles that died)
    # and installs `version` in them; None: a death raises
    recover: Optional[Callable[..., Any]] = None
    inject: Callable[[str], None] = lambda phase: None  # chaos: kills engines as a phase's calls go out

    @staticmethod
    def start(cfg: RunConfig, dm, model_dir: str, sync_layout, log=print, name_prefix: str = "",
              shm_record: Optional[Path] = None, recover: Optional[Callable[..., Any]] = None,
              inject: Optional[Callable[[str], None]] = None) -> "Roles":
        """`shm_record`: a file in the run's directory listing the engines' shared memory (`record_shm`); one a
        killed driver left names what its engines' processes left in /dev/shm, and the new engines remove it.
        `recover`, `inject`: the driver's engine replacement and chaos injection (the fields of those names)."""
        import ray
        from ray.util.placement_group import placement_group

        from actors.environment import EnvironmentWorker
        from actors.reward import RewardModelWorker, RuleRewardWorker
        from actors.trainer_worker import PolicyWorker, TrainerWorker
        from actors.vllm.engine import VLLMEngine
        from rlhf.host_allocator import allocator_env, allocator_name, huge_page_env
        from rlhf.parallel.comm import backend_for
        from rlhf.placement import actor_options, engine_cpu_cores, placement_bundles

        p = cfg.placement
        pgs = [placement_group(bundles, strategy="STRICT_PACK") for bundles in placement_bundles(p)]
        try:
            ray.get([pg.ready() for pg in pgs], timeout=120)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster cannot host the placement ({p.nodes} node(s) x {p.devices_per_node} "
                               f"{p.device_type.value} device(s), each {placement_bundles(p)[0][0]}); check "
                               f"`ray status` against the placement file") from None

        def slot(role: str, rank: int) -> dict:
            return actor_options(dm, p, role, rank).spawn_kwargs(pgs) | {"name_prefix": name_prefix}

        dt, W = p.device_type, sync_layout.trainer.world_size
        ref_trainer = replace(cfg.trainer, routing_replay=RoutingReplay.off)  # the policy's routes are not its own

        # on cpu a trainer's heap comes back at every update, a sleeping engine's weights and KV cache at every wake
        env = huge_page_env() if dt is DeviceType.cpu else None
        trainer_env = allocator_env(cfg.trainer.cpu_allocator.value) if dt is DeviceType.cpu else None

        def start_policy(stale_pids: Sequence[int] = ()) -> tuple[list[RoleHandle], list[RoleHandle]]:
            """Trainer and reference ranks on their slots; `stale_pids`: the processes they replace."""
            probe_s = cfg.trainer.liveness_probe_s
            trainer = [spawn(TrainerWorker, "trainer", r, cfg.model, cfg.trainer, cfg.algorithm, dt, r, model_dir,
                             stale_pids=tuple(stale_pids), probe_s=probe_s, env=trainer_env, **slot("trainer", r))
                       for r in range(W)]
            reference = [spawn(PolicyWorker, "reference", r, cfg.model, ref_trainer, dt, r, model_dir,
                               probe_s=probe_s, env=trainer_env, **slot("reference", r)) for r in range(W)] \
                if "reference" in dm.role_names else []
            return trainer, reference

        trainer, reference = start_policy()
        rpe = dm.ranks_per_engine
        # partial rollouts: a sync's install runs on a second thread while the generation parks between steps
        # (a third for an evaluation waiting its turn)
        partial = cfg.stale_sync.partial_rollout

        def start_engine(k: int, stale_shm: Sequence[str] = ()) -> RoleHandle:
            return spawn(VLLMEngine, "rollout", k, model_dir, cfg.rollout, dt, seed=cfg.seed + k,
                         max_model_len=cfg.model.max_position_embeddings,
                         cpu_cores=engine_cpu_cores(dm, k, os.cpu_count() or 1), own_process=True,
                         interruptible=partial, capture_routes=cfg.captures_routes, stale_shm=tuple(stale_shm),
                         max_concurrency=3 if partial else 1, probe_s=cfg.rollout.liveness_probe_s,
                         whole_prefills=cfg.agent.enabled, env=env, **slot("rollout", k * rpe))

        left = recorded_shm(shm_record)
        if left:  # every engine gets the whole list: each removes what is on its node (the names are unique)
            log(f"roles: this run's last driver ended before it closed its engines; the new engines remove what "
                f"is left of the shared memory it recorded for them ({', '.join(left)})")
        engines = [start_engine(k, stale_shm=left) for k in range(cfg.rollout.num_engines)]
        rewards: list[RoleHandle] = []  # none in agent runs: their environments (or agent function) reward
        if "reward" in dm.role_names and cfg.reward.kind is RewardKind.model:
            rm_dir = str(Path(cfg.reward.model_path).resolve())  # actors may not share the driver's cwd
            rewards = [spawn(RewardModelWorker, "reward", i, rm_dir, device_type=dt, **slot("reward", i))
                       for i in range(cfg.reward.workers)]
        elif "reward" in dm.role_names:
            rewards = [spawn(RuleRewardWorker, "reward", i, cfg.reward.kind, cfg.reward.sandbox, **slot("reward", i))
                       for i in range(cfg.reward.workers)]

        def start_environment(i: int) -> RoleHandle:
            return spawn(EnvironmentWorker, "environment", i, cfg.agent.environment, dict(cfg.agent.environment_args),
                         cfg.agent.step_timeout_s, **slot("environment", i))

        environments = [start_environment(i) for i in range(cfg.agent.workers)] \
            if "environment" in dm.role_names else []
        roles = Roles(trainer, reference, engines, rewards, pgs, cfg.trainer.collective_timeout_s + 60,
                      environments=environments, start_environment=start_environment,
                      recover=recover, inject=inject or (lambda phase: None))
        roles.start_engine, roles.start_policy, roles.sync_layout = start_engine, start_policy, sync_layout
        roles.environment_timeout_s = cfg.agent.step_timeout_s
        roles.sync_backend = backend_for(dt.value, cfg.trainer.backend.value)
        roles.sync_timeout_s = cfg.trainer.collective_timeout_s
        log(f"roles: {W} trainer rank(s), {len(reference)} reference rank(s), {len(engines)} engine(s), "
            + (f"{len(environments)} environment worker(s)" if environments else f"{len(rewards)} reward worker(s)")
            + " starting" + (f"; trainer processes on {allocator_name(trainer_env)}'s malloc "
                             f"(trainer.cpu_allocator={cfg.trainer.cpu_allocator.value})" if trainer_env else ""))
        roles.init_policy()
        roles.engine_shm = call_all([(e, "shm_prefixes", (), {}) for e in engines], START_TIMEOUT_S)  # engines up
        roles.engine_pids = call_all([(e, "pid", (), {}) for e in engines], START_TIMEOUT_S)
        kernels = call_all([(e, "moe_kernel_counts", (), {}) for e in engines], START_TIMEOUT_S)
        if any(kernels):
            log("roles: the engines' MoE layers by experts' kernel (rollout.cpu_moe_kernel): "
                + ", ".join(f"engine {k} {c}" for k, c in enumerate(kernels)))
        call_all([(h, "pid", (), {}) for h in environments], START_TIMEOUT_S)  # environment workers up
        roles.shm_record = shm_record
        roles.record_shm()
        roles.hang_timeout_s = cfg.rollout.hang_timeout_s
        roles.join_sync()
        log(f"roles: every group joined (trainer, reference, weight sync: {W} trainer ranks and "
            f"{sync_layout.engines.world_size} engine ranks)")
        return roles

    def environment_pool(self, stop, log=print):
        """The environment workers as the episode runner's `Environments` (a dead or hung worker is replaced on
        its slot and its episodes begun again: `actors.environment.EnvironmentPool`); one pool for every caller
        (StaleSync's producer and an evaluation at once replace a dead worker once)."""
        from actors.environment import EnvironmentPool

        stop = tuple(stop)
        if stop not in self.environment_pools:
            self.environment_pools[stop] = EnvironmentPool(self.environments, self._restart_environment, stop,
                                                           self.environment_timeout_s, log, self.inject)
        return self.environment_pools[stop]

    def _restart_environment(self, i: int) -> RoleHandle:
        h = self.start_environment(i)
        h.call("pid", timeout_s=START_TIMEOUT_S)
        return h

    def init_policy(self) -> None:
        """Trainer and reference ranks form their process groups and load their shards."""
        for group in (self.trainer, self.reference):
            if group:
                addr = group[0].call("address", self.local)
                call_all([(h, "init", addr, {}) for h in group], START_TIMEOUT_S)
        self.policy_pids = call_all([(h, "pid", (), {}) for h in self.trainer + self.reference], START_TIMEOUT_S)

    def restart_policy(self) -> None:
        """Every trainer and reference rank stopped and started again on its slot (a process group cannot
        take a new member: all are new), their groups formed, the weights loaded from the model directory,
        and the weight-sync group re-formed. The caller restores a checkpoint."""
        for h in self.trainer + self.reference:
            try:
                h.kill(hung=True)  # one of them may be
            except Exception:
                pass
        self.trainer, self.reference = self.start_policy(stale_pids=self.policy_pids)
        self.init_policy()
        self.join_sync()

    def follow_layout(self, sync_layout) -> None:
        """The weight-sync layout changed (experts moved): the group re-forms by it from now on."""
        self.sync_layout = sync_layout

    @property
    def local(self) -> bool:
        """Every role on one node (one placement group per node): the groups listen on loopback alone."""
        return len(self.placement_groups) == 1

    def join_sync(self) -> None:
        """Every trainer rank and engine (re)joins the weight-sync group, on a fresh port: the group is
        stateless, so a replaced member means a new group for all (each leaves its old one first)."""
        host, port = self.trainer[0].call("address", self.local)
        lay = self.sync_layout
        call_all([(h, "join_sync", (host, port, lay.world_size), {}) for h in self.trainer]
                 + [(e, "join_sync", (host, port, lay.engine_ranks(k)[0], lay.world_size, self.sync_backend,
                                      self.sync_timeout_s), {}) for k, e in enumerate(self.engines)],
                 START_TIMEOUT_S)

    # --- dead engines ---
    def dead_engines(self, probe_s: float = 1.0) -> list[int]:
        """Engines whose actor is dead (`dead`)."""
        return dead(self.engines, "shm_prefixes", probe_s)

    def dead_policy_rank(self, probe_s: float = 1.0) -> Optional[RoleHandle]:
        """A trainer or reference rank whose actor is dead, if one is."""
        for group in (self.trainer, self.reference):
            gone = dead(group, "pid", probe_s)
            if gone:
                return group[gone[0]]
        return None

    def silent_policy_rank(self) -> Optional[RoleHandle]:
        """A trainer or reference rank whose process answers no liveness probe within its `probe_s` (a probe
        is answered on a thread of its own, however busy the rank), if one does: the rank that hangs."""
        import ray

        ranks = [h for h in self.trainer + self.reference if h.probe_s > 0]
        if not ranks:
            return None
        refs = [h.probe() for h in ranks]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(h.probe_s for h in ranks))
        return next((h for h, ref in zip(ranks, refs) if ref not in ready), None)

    def replace_engines(self, dead: Sequence[int]) -> None:
        """New engines on the dead ones' placement slots (each removes the shared memory its predecessor's
        workers left), then the weight-sync group re-formed with every member. The new engines serve no
        weights of the run yet: the caller installs them (`sync_weights`)."""
        for k in dead:
            try:
                self.engines[k].kill(hung=True)  # dead already, or stuck: its slot must be free
            except Exception:
                pass
            self.engines[k] = self.start_engine(k, stale_shm=self.engine_shm[k])
        replies = call_all([(self.engines[k], m, (), {}) for k in dead for m in ("shm_prefixes", "pid")],
                           START_TIMEOUT_S)
        for k, prefixes, pid in zip(dead, replies[::2], replies[1::2]):
            self.engine_shm[k], self.engine_pids[k] = prefixes, pid
        self.record_shm()
        self.join_sync()

    def record_shm(self) -> None:
        """The engines' shared-memory names (`engine_shm`) written to `shm_record` (replaced whole): if the
        driver is killed, its engines' processes go with it and nobody unlinks what they held (for an engine of
        several workers, its message queues' segments); the run's next
        driver reads the list (`recorded_shm`) and its engines remove them. Removed at a clean shutdown."""
        if self.shm_record is None:
            return
        tmp = self.shm_record.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted({n for names in self.engine_shm for n in names})))
        os.replace(tmp, self.shm_record)

    # --- fan-out calls ---
    def all(self, group: Sequence[RoleHandle], method: str, *args, timeout_s: float | None = None,
            per_rank: Sequence[dict] | None = None, **kwargs) -> list:
        """`method` on every rank at once; `per_rank`: keyword arguments of each rank's own."""
        return self.wait(self.submit(group, method, *args, per_rank=per_rank, **kwargs), timeout_s)

    def submit(self, group: Sequence[RoleHandle], method: str, *args, per_rank: Sequence[dict] | None = None,
               **kwargs) -> tuple[list, list]:
        """`all`'s calls sent and not waited for (`wait`), so that others can be queued behind them."""
        extra = per_rank or [{}] * len(group)
        return self._send([(h, method, args, kwargs | e) for h, e in zip(group, extra)], method)

    def _send(self, calls: list, phase: str) -> tuple[list, list]:
        subs = [h.submit(m, *a, **kw) for h, m, a, kw in calls]
        self.inject(phase)  # chaos: kills as the phase's calls go out
        return calls, subs

    def wait(self, sent: tuple[list, list], timeout_s: float | None = None) -> list:
        """The results of calls `submit` sent (deadline from now), as `all` returns them."""
        return call_all(sent[0], timeout_s or self.timeout_s, probe=True, submitted=sent[1])

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seed: int, phase: str = "generate",
                 route_stages: Sequence[Sequence[int]] | None = None, seeds: Sequence[int] | None = None,
                 engine_of: Sequence[int] | None = None, max_tokens: Sequence[int] | None = None,
                 **kwargs) -> list:
        """Completions of every prompt, prompts split evenly over the engines; prompt_index refers to `prompts`.
        Prompt i is seeded `prompt_seed(seed, i)`, or `seeds[i]` where given. `engine_of`: prompt i goes to
        engine engine_of[i] % engines instead (session affinity: every turn of an episode on the engine that
        holds its prefix in cache). `max_tokens`: one cap per prompt.

        `route_stages` (engines capturing routes): each completion's `routes` is a `rlhf.moe.routing.RouteRef`
        to blocks each engine left in the object store, one per trainer stage (its MoE layers), owned here
        and never fetched here; without it the engines drop the call's routes.

        An engine that dies meanwhile, or hangs (no answer within `hang_timeout_s`, or its process silent to
        liveness probes for its `probe_s`), is handed to
        `self.recover` (which kills and replaces it and installs the weights the others serve) and its share
        generated again there, with the same seeds: the call returns what it would have without the fault.
        Without `recover` the failure raises RoleError."""
        from dataclasses import replace

        k = len(self.engines)
        if engine_of is None:
            chunks = [list(range(i, len(prompts), k)) for i in range(k)]
        else:
            chunks = [[i for i, e in enumerate(engine_of) if e % k == j] for j in range(k)]

        def call(e: int) -> tuple:  # seeds by the prompt's place in the whole call: not by the engine count
            kw = dict(n=n, seed=[seeds[i] if seeds else prompt_seed(seed, i) for i in chunks[e]], **kwargs)
            if max_tokens is not None:
                kw["max_tokens"] = [max_tokens[i] for i in chunks[e]]
            if route_stages is None:
                return calls_made[e], "generate", ([prompts[i] for i in chunks[e]],), kw | dict(keep_routes=False)
            return (calls_made[e], "generate_routed", ([prompts[i] for i in chunks[e]], route_stages),
                    kw | dict(_num_returns=1 + len(route_stages)))

        todo, outs = [e for e in range(k) if chunks[e]], [[] for _ in range(k)]
        while todo:
            calls_made = {e: self.engines[e] for e in todo}  # the handles called (another thread may replace one)
            results = call_each([call(e) for e in todo], self.hang_timeout_s or self.timeout_s,
                                on_submit=lambda: self.inject(phase), probe=True)
            dead = [e for e, r in zip(todo, results) if isinstance(r, RoleError) and (r.died or r.hung)]
            for e, r in zip(todo, results):
                if isinstance(r, BaseException) and (e not in dead or self.recover is None):
                    raise r
                if e not in dead:
                    outs[e] = r if route_stages is None else [
                        replace(c, routes=replace(c.routes, blocks=tuple(r[1]))) for c in r[0]]
            if dead:
                self.recover(dead, str(next(r for e, r in zip(todo, results) if e in dead)),
                             [calls_made[e] for e in dead])
            todo = dead
        merged = [replace(c, prompt_index=idx[c.prompt_index]) for idx, out in zip(chunks, outs) for c in out]
        return sorted(merged, key=lambda c: c.prompt_index)  # stable: samples of a prompt keep their order

    def stream(self, prompts: Sequence[Sequence[int]], n: int, seed: int, phase: str = "generate"):
        """`generate`, streamed: a `GroupStream` handing back each prompt's group as its engine finishes it."""
        from actors.group_stream import GroupStream

        return GroupStream(self, prompts, n, seed, phase)

    def submit_score(self, responses: Sequence[str], answers: Sequence[str], prompts: Sequence[str]) -> tuple:
        """Scores of the responses, split evenly over the reward workers (a reward model reads prompt + response):
        the calls sent, their replies read by `wait_score`."""
        k = len(self.rewards)
        bounds = [len(responses) * i // k for i in range(k + 1)]
        calls = [(w, "score", (responses[a:b], answers[a:b]), {"prompts": prompts[a:b]})
                 for w, a, b in zip(self.rewards, bounds, bounds[1:]) if b > a]
        return calls, [h.submit(m, *a, **kw) for h, m, a, kw in calls]

    def wait_score(self, sent: tuple) -> list[ScoreReply]:
        return self.wait(sent)

    def score_ready(self, sent: tuple) -> bool:
        import ray

        return len(ray.wait(sent[1], num_returns=len(sent[1]), timeout=0)[0]) == len(sent[1])

    def logprobs(self, group: Sequence[RoleHandle], batch_ref, per_rank: Sequence[dict] | None = None) -> tuple:
        """(logp [B, T-1], entropy [B, T-1], per-rank replies) of a policy group over the whole batch."""
        outs = self.all(group, "logprobs", batch_ref, per_rank=per_rank)
        return (*batch_logprobs(outs), outs)

    def ray_nodes(self) -> list[str]:
        """The Ray node each placement node's group landed on (node ids), in placement-node order: where the
        run really is, beside the placement file's numbering."""
        import ray

        return [ray.util.placement_group_table(pg)["bundles_to_node_id"][0] for pg in self.placement_groups]

    def link_probe(self, sync_layout, nbytes: int = 32 << 20, rounds: int = 4) -> float:
        """Bytes per second from trainer rank 0 to the last engine's first worker over the weight-sync group
        (the link the sync floor is measured against): a second or less at start."""
        k = len(self.engines) - 1
        _, speed = call_all([(self.trainer[0], "link_probe", (sync_layout.engine_ranks(k)[0], nbytes, rounds), {}),
                             (self.engines[k], "link_probe", (0, nbytes, rounds), {})], self.timeout_s)
        return float(speed)

    def sync_weights(self, sync_layout, version: int, same_device=frozenset(), posted=None) -> SyncReplies:
        """Trainer ranks send, engine hosts receive and install (pairs in `same_device` through shared
        memory). A rank whose process answers no liveness probe for its `probe_s` fails the sync at once
        (RoleError.hung) instead of after the group's timeout. `posted`: what `submit_sync(..., posted=True)`
        sent with the update, waited for here."""
        if posted is None:
            posted = self.submit_sync(sync_layout, version, same_device)
        replies = call_all(posted[0], self.timeout_s, probe=True, submitted=posted[1])
        self.version = version
        return SyncReplies(replies[:len(self.trainer)], replies[len(self.trainer):])

    def submit_sync(self, sync_layout, version: int, same_device=frozenset(), posted: bool = False) -> tuple:
        """The sync of `version`'s calls sent, for `sync_weights` to wait for. `posted`: sent right after the
        trainer's update calls (`submit`): each trainer rank's send runs on its actor right behind its update
        (if the update failed it sends nothing and tells the engines so), and the engines, idle meanwhile, are
        already waiting for it: no driver round trip between the update's end and the sync's start."""
        go = {"posted": True} if posted else {}
        calls = [(h, "send_weights", (sync_layout, same_device), go) for h in self.trainer]
        wait = {"wait_s": self.timeout_s + 60.0} if posted else {}  # outlasts the update's own deadline
        calls += [(e, "receive_weights", (sync_layout, version, same_device), wait) for e in self.engines]
        return self._send(calls, "sync")

    def shutdown(self) -> None:
        import ray

        # the engines close side by side (each mostly waits for its own processes to exit), within a limit that
        # outlasts the grace close gives vLLM's processes
        try:
            closed = call_each([(e, "close", (), {}) for e in self.engines], timeout_s=SHUTDOWN_GRACE_S + 60)
        except Exception as e:
            closed = [e]
        if self.shm_record is not None and not any(isinstance(c, Exception) for c in closed):
            self.shm_record.unlink(missing_ok=True)  # each engine removed its own shared memory
        # rewards and environments let go of their programs' interpreters and directories (a killed actor runs
        # no exit handler); one that fails or hangs here is killed all the same
        try:
            call_each([(h, "release", (), {}) for h in self.rewards + self.environments], timeout_s=RELEASE_TIMEOUT_S)
        except Exception:
            pass
        for h in self.trainer + self.reference + self.engines + self.rewards + self.environments:
            try:
                h.kill()
            except Exception:
                pass
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)


def recorded_shm(path: Optional[Path]) -> list[str]:
    """The shared-memory names a run's last driver recorded for its engines (`Roles.record_shm`), if it left a
    record: killed before its engines were closed."""
    if path is None or not path.is_file():
        return []
    try:
        names = json.loads(path.read_text())
    except ValueError:  # cut short while it was written: nothing to go by
        return []
    return [n for n in names if isinstance(n, str) and n and "/" not in n]


def dead(group: Sequence[RoleHandle], method: str, probe_s: float = 1.0) -> list[int]:
    """Indices of the ranks whose actor is dead, probed with a cheap `method`. A dead actor's call fails at
    once (Ray knows it died); a live one busy with a long call is not waited for: a probe unanswered within
    `probe_s` counts as alive."""
    import ray

    refs = [h.submit(method) for h in group]
    if not refs:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=probe_s)
    out = []
    for i, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                out.append(i)
    return out


def connect(p, log=print) -> bool:
    """Join the Ray cluster named by RAY_ADDRESS (as `ray job submit` sets it), or start an embedded
    local instance that offers the placement's devices. True when this process started Ray (and so
    shuts it down)."""
    import os

    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        log(f"ray: joined the cluster at {os.environ['RAY_ADDRESS']}")
        return True

    devices = p.nodes * p.devices_per_node
    resources = {p.device_resource: devices} if p.device_type is DeviceType.cpu else {}
    # Logical CPUs: each device bundle asks for cpus_per_device; a small machine still hosts the placement
    # (processes share its cores, as co-located roles do).
    num_cpus = max(os.cpu_count() or 1, int(devices * p.cpus_per_device + 0.999))
    # address="local": a new instance even where /tmp/ray/ray_current_cluster names another (left by `ray start`
    # or ray.cluster_utils, alive or long dead); with no address Ray would join that one and refuse num_cpus.
    private_auth_token(log)
    ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=False)
    log(f"ray: started an embedded local instance ({num_cpus} CPUs, {resources or 'no custom resources'}); "
        f"actor logs are under /tmp/ray/session_latest/logs")
    return True


def private_auth_token(log=print) -> None:
    """Before an embedded instance starts. Ray 2.60's servers (GCS, raylet, workers) listen on every interface
    whatever node address they are given, so what keeps others out is Ray's token auth, on by default for a
    local instance (RAY_AUTH_MODE unset): every call must carry the token. Ray writes that token to
    ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH) with the default umask, readable by every local user; here it is
    written, or made, readable by its owner alone. An explicit RAY_AUTH_MODE=disabled is respected, and said."""
    import os
    import secrets
    import stat
    from pathlib import Path

    mode = os.environ.get("RAY_AUTH_MODE", "").lower()
    if mode and mode != "token":
        log(f"ray: warning: RAY_AUTH_MODE={mode}: the embedded instance takes calls from anyone who reaches this "
            "machine (Ray's servers listen on every interface); unset it to keep Ray's token auth on")
        return
    if os.environ.get("RAY_AUTH_TOKEN"):
        return  # the token comes from the environment: no file
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # as Ray makes one: 256 random bits
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    st = path.stat()
    if st.st_mode & 0o077 and st.st_uid == os.getuid():
        os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        log(f"ray: {path} (Ray's auth token) was readable by other users; now by its owner alone")


def batch_logprobs(replies: Sequence[Optional[LogprobsReply]]) -> tuple:
    """(logp [B, T-1], entropy [B, T-1]) in batch order, from the ranks' replies (None from ranks that
    return no rows)."""
    import torch

    parts = [r for r in replies if r is not None]
    order = torch.argsort(torch.cat([r.rows for r in parts]))
    return torch.cat([r.logp for r in parts])[order], torch.cat([r.entropy for r in parts])[order]


def batch_route_differs(replies: Sequence[Optional[LogprobsReply]]):
    """Per token [B, T], how many MoE layers chose another expert set than the engine, in batch order;
    None where the replies measured none (no engine routes in the batch)."""
    import torch

    parts = [r for r in replies if r is not None]
    if not parts or any(r.route_differs is None for r in parts):
        return None
    order = torch.argsort(torch.cat([r.rows for r in parts]))
    return torch.cat([r.route_differs for r in parts])[order]
