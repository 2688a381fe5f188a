"""A run's state around the loop: its inputs, checked before any actor starts (`RunInputs`), and the run
itself (`Run`): roles, phases and their timing, co-location switches, evaluation, checkpoints, the
step's record and the final result.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from actors.replies import SyncReplies, UpdateReply
from actors.roles import Roles, connect
from rlhf.batch import TokenBatch
from rlhf.checkpoint import (commit, export_hf, fresh_run_problem, prune, queued_groups_problem, resolve_resume,
                             rng_state, set_rng_state, step_dir)
from rlhf.config.load import as_dict
from rlhf.data.prompts import DatasetError, PromptRow, fit_context, load_prompts, valid_answers
from rlhf.data.sandbox import parse_tests
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenizer import load_tokenizer
from rlhf.driver.balance import ExpertBalancing
from rlhf.driver.faults import Recovery
from rlhf.driver.metrics import progress_fields, step_metrics
from rlhf.driver.rollout import Rollout, heldout_accuracy
from rlhf.errors import ConfigError
from rlhf.model.hf_io import check_model_dir
from rlhf.routing import RouteFetch
from rlhf.parity import Parity, parity_problem, run_parity_limit
from rlhf.placement import DeviceMap, device_map
from rlhf.placement.transfer import SyncLayout, sync_layout
from rlhf.config.chaos import engine_kills, trainer_kills
from rlhf.schema import DeviceType, RewardKind, RunConfig
from rlhf.sim.workload import attention_quadratic
from rlhf.tiny import make_tiny_args
from rlhf.tracking import Progress, Trace, Tracker
from weight_sync.plan import Plan

Log = Callable[[str], None]
ENGINE_SHM_RECORD = "engine_shm.json"  # the engines' shared memory, for the run's next driver (Roles.record_shm)


@dataclass(frozen=True)
class RunInputs:
    """Everything a run reads or decides before any actor starts; `prepare` fails on any bad input."""

    model_dir: str
    device_map: DeviceMap
    tokenizer: object  # tokenizers.Tokenizer
    sampler: PromptSampler
    heldout: list[PromptRow]
    sync: SyncLayout
    plan: Plan  # the weight-sync plan, validated
    same_device: frozenset[tuple[int, int]]  # transfer-rank pairs on one device: through shared memory
    resume_dir: Optional[Path]
    out: Path

    @staticmethod
    def prepare(cfg: RunConfig, log: Log) -> "RunInputs":
        model_dir = str(check_model_dir(cfg.model, make_tiny_args(cfg)))
        dm = device_map(cfg)
        d = cfg.data
        tokenizer = load_tokenizer(model_dir)
        # at most data.max_prompt_tokens, and room left for the longest answer in the engines' context (the
        # model's positions)
        room = cfg.model.max_position_embeddings - cfg.rollout.max_new_tokens
        limit, what = ((d.max_prompt_tokens, "data.max_prompt_tokens") if d.max_prompt_tokens <= room else
                       (room, f"model.max_position_embeddings={cfg.model.max_position_embeddings} less "
                              f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}"))

        def prompts(key: str):
            try:
                rows = load_prompts(getattr(d, key), d.prompt_key, d.answer_key, d.skip_bad_rows)
                if cfg.reward.kind is RewardKind.code:  # tests that cannot run would score every sample 0
                    rows = valid_answers(rows, parse_tests, "tests for reward.kind=code", d.skip_bad_rows)
                return fit_context(rows, lambda p: len(tokenizer.encode(p).ids), limit, what, d.skip_bad_rows)
            except DatasetError as e:
                raise DatasetError(f"data.{key}: {e}") from None

        train_rows, heldout = prompts("train_files"), prompts("heldout_files").rows
        c = cfg.checkpoint
        resume_dir = resolve_resume(Path(c.dir), c.resume)
        problem = (fresh_run_problem(c.dir, c.resume, saves=bool(c.every_steps) or c.export_hf)
                   or queued_groups_problem(resume_dir, cfg.stale_sync.max_staleness))
        if problem:  # found before any actor starts, not at the final save or at a silently skipped prompt
            raise ConfigError(problem)
        sync = sync_layout(cfg, dm)  # the function `rlhf plan` uses: the same ranks, plan and bytes
        plan = sync.plan()  # validated before any actor starts
        # Co-located trainer and engine ranks exchange through shared memory: /dev/shm on cpu, device memory
        # shared by IPC handle on cuda (nccl refuses two ranks on one GPU; run on an H100:
        # tests/dist/test_device_weight_sync.py). npu: not yet run on a device, so there the group carries all.
        same_device = sync.same_device_pairs() if dm.device_type is not DeviceType.npu else frozenset()
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # set by `ray job submit` for the job's driver
            rel = [k for k, v in (("output_dir", cfg.output_dir), ("tracking.dir", cfg.tracking.dir),
                                  ("checkpoint.dir", cfg.checkpoint.dir)) if not Path(v).is_absolute()]
            if rel:
                log(f"warning: {', '.join(rel)} relative in a Ray job: written into the job's temporary copy of "
                    "the working dir and lost when it ends; pass absolute paths")
        return RunInputs(model_dir, dm, tokenizer,
                         PromptSampler(train_rows.rows, d.prompts_per_step, cfg.seed, d.shuffle), heldout, sync,
                         plan, same_device, resume_dir, out)


@dataclass
class Run(Recovery, ExpertBalancing):
    """One run: its inputs, its roles once started, and what it has done so far."""

    cfg: RunConfig
    inputs: RunInputs
    log: Log
    tracker: Tracker
    roles: Optional[Roles] = None
    ray_owned: bool = False  # this process started Ray, so it stops it
    step: int = 0  # the last step done (the weights' version)
    progress: Optional[Progress] = None
    history: list[dict] = field(default_factory=list)  # a few metrics per step, for the result
    accuracy: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out accuracy)
    accuracy_seconds: list[float] = field(default_factory=list)  # when each was measured, from the run's start
    eval_seconds: dict[int, float] = field(default_factory=dict)  # how long the evaluation after each step took
    parity_violations: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)  # this step's driver phases
    switch_bytes: dict[str, int] = field(default_factory=dict)  # bytes moved by the last onload / offload
    last_checkpoint: Optional[Path] = None
    link_bytes_per_s: float = 0.0  # the weight-sync link, measured at start (the floor's bandwidth)
    ray_nodes: list[str] = field(default_factory=list)  # the Ray node of each placement node
    load_prediction: Optional[list] = None  # tokens per expert per MoE layer, moving average (expert_load/*; checkpointed)
    load_metrics: dict = field(default_factory=dict)  # this step's expert_load/* from observe_expert_loads
    expert_maps: Optional[tuple] = None  # the trainer's expert -> EP shard map per MoE layer once balanced (checkpointed)
    engine_experts: Optional[tuple] = None  # the engines' placement per MoE layer once it follows (checkpointed)
    sync_seconds: float = 0.0  # summed over steps, for the sync's share of the run
    step_seconds: float = 0.0
    last_sync: Optional[SyncReplies] = None
    train_seconds: float = 0.0  # step time less evaluation: what throughput is measured over
    samples_dropped: int = 0  # StaleSync: samples too old to train on
    extra_state: Optional[Callable[[Path], dict]] = None  # more driver state for a checkpoint dir (StaleSync's queue)
    at_step: int = 0  # the step in progress (or the one just evaluated): where faults are counted and injected
    trainer_offloaded: bool = False  # co-location: the trainer's state is in host memory (engines' turn)
    engines_asleep: bool = False  # co-location: the engines released their memory (trainer's turn)
    posted_sync: list = field(default_factory=list)  # the references of a sync posted with an update that failed
    engine_restarts: list[int] = field(default_factory=list)  # the step of each engine replacement
    trainer_restarts: int = 0  # times every trainer and reference rank was restarted from a checkpoint
    steps_redone: int = 0  # steps done again after those restarts
    kills: list = field(default_factory=list)  # chaos kills still to inject: (step, role, index, phase)
    # Engine replacement asked for by another thread (StaleSync's producer) is done by this one, the driver's
    # main thread, where it knows the trainer idle (`serve_recoveries`).
    main_thread: threading.Thread = field(default_factory=threading.current_thread)
    recovery_cv: threading.Condition = field(default_factory=threading.Condition)
    recovery_requests: list = field(default_factory=list)
    recovery_closed: bool = False
    wake_main: Callable[[], None] = lambda: None  # the main thread may be waiting on another condition
    producer_batch: int = 0  # StaleSync: the batch the producer makes (where its generation's kills land)
    t0: float = field(default_factory=time.time)

    @staticmethod
    def start(cfg: RunConfig, log: Log) -> "Run":
        """Check every input, then start Ray and the roles (stopped again if anything fails)."""
        inputs = RunInputs.prepare(cfg, log)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        tracker = Tracker(cfg.tracking, as_dict(cfg))
        tracker.trace = Trace(inputs.out / "trace.json", enabled=cfg.tracking.trace)
        run = Run(cfg, inputs, log, tracker)
        if inputs.resume_dir is None:  # a new run's steps.jsonl starts empty; a resumed run appends
            (inputs.out / "steps.jsonl").unlink(missing_ok=True)
        try:
            run.ray_owned = connect(cfg.placement, log)
            with run.phase("start roles", 0):
                run.roles = Roles.start(cfg, inputs.device_map, inputs.model_dir, inputs.sync, log,
                                        shm_record=inputs.out / ENGINE_SHM_RECORD)
            run.roles.recover = run.recover_engines
            run.roles.inject = run._inject
            run.kills = ([(s, "rollout", k, ph) for s, k, ph in engine_kills(cfg.chaos.kill_engines)]
                         + [(s, "stop rollout", k, ph) for s, k, ph in engine_kills(cfg.chaos.stop_engines)]
                         + [(s, "trainer", r, ph) for s, r, ph in trainer_kills(cfg.chaos.kill_trainer_ranks)]
                         + [(s, "stop trainer", r, ph) for s, r, ph in trainer_kills(cfg.chaos.stop_trainer_ranks)])
            run.link_bytes_per_s = run.roles.link_probe(inputs.sync)
            run.ray_nodes = run.roles.ray_nodes()
            if inputs.resume_dir is not None:
                run._resume(inputs.resume_dir)
        except BaseException:  # an actor that failed to start: stop what did start, and Ray if we started it
            run.close(failed=True)
            raise
        run.progress = Progress(cfg.steps, start_step=run.step)
        dm = inputs.device_map
        log(f"train: {cfg.steps} steps from step {run.step}; trainer {inputs.sync.trainer} on devices "
            f"{dm.devices_of('trainer')}, {cfg.rollout.num_engines} engine(s) on {dm.devices_of('rollout')}; "
            f"sync plan {inputs.plan.bytes_minimal / 1e6:.2f} MB per step to {inputs.sync.engines.world_size} engine "
            f"rank(s), link measured at {run.link_bytes_per_s / 1e9:.2f} GB/s")
        return run

    # --- pieces of a step ---
    @contextmanager
    def phase(self, name: str, step: int):
        """Time a driver phase: a trace event and the step's `time/<phase>` metric."""
        t0 = time.time()
        with self.tracker.trace.phase(name, "driver", step):
            yield
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + time.time() - t0

    def put(self, obj):
        import ray

        return ray.put(obj)

    @property
    def route_stages(self) -> list[list[int]] | None:
        """The MoE layer indices of each trainer pipeline stage, when the engines capture routes: the blocks
        the engines keep them in (`Roles.generate`), so a stage reads only its layers."""
        if not self.cfg.captures_routes:
            return None
        m, lay = self.cfg.model, self.inputs.sync.trainer
        return [[l - m.first_k_dense_layers for l in r if l >= m.first_k_dense_layers]
                for r in lay.stage_layers(m.num_hidden_layers)]

    def route_shares(self, ro: Rollout, batch: TokenBatch, row_lists) -> tuple[list[dict], dict]:
        """What each trainer rank reads of the engines' routes (its DP index's samples in the calls over
        `row_lists`, its stage's MoE layers) as call kwargs, one `RouteFetch` per (DP index, stage): object
        references and row places only, so the routes go from the engines' blocks to the ranks; and the
        bytes the ranks read."""
        m, t = self.cfg.model, self.cfg.trainer
        lay = self.inputs.sync.trainer
        refs = [c.routes for c in ro.completions]
        L, T = m.num_hidden_layers - m.first_k_dense_layers, batch.input_ids_BT.shape[1]
        fetch = {}
        for dp in range(lay.dp):
            rows = batch.dp_rows(row_lists, lay.dp, dp, t.micro_batch_tokens)
            for stage, layers in enumerate(self.route_stages):
                fetch[dp, stage] = RouteFetch(tuple(rows), tuple(refs[r] for r in rows), stage, tuple(layers), L,
                                              m.num_experts_per_tok, T)
        per_rank = [{"routes": fetch[c.dp, c.pp]} for c in map(lay.coords, range(lay.world_size))]
        sizes = [f.nbytes for f in fetch.values()]
        stored = sum(r.nbytes(L, m.num_experts_per_tok) for r in refs)
        return per_rank, {"route/bytes_sent": sum(sizes), "route/bytes_per_rank_max": max(sizes),
                          "route/bytes_stored": stored}

    def token_batch(self, ro: Rollout) -> TokenBatch:
        G = self.cfg.algorithm.group_size
        prompts = [ro.prompt_ids[i // G] for i in range(len(ro.completions))]
        return TokenBatch.from_samples(prompts, [c.token_ids for c in ro.completions],
                                       [c.logp for c in ro.completions], self.cfg.model.pad_token_id,
                                       self.cfg.rollout.temperature  # routes go apart (`route_shares`)
                                       ).with_(attention_cost=attention_quadratic(self.cfg.model))

    def mini_batches(self, n: int, step: int) -> list[list[int]]:
        """Sample indices of each mini-batch, shuffled per step (the same list goes to every rank)."""
        order = list(range(n))
        random.Random(self.cfg.seed * 7919 + step).shuffle(order)
        size = min(self.cfg.trainer.mini_batch_size, n)
        return [order[i:i + size] for i in range(0, n, size)]

    def switch(self, engine_method: str, trainer_method: str) -> None:
        """Co-location: engines sleep / wake, trainer and reference onload / offload."""
        roles, level = self.roles, self.cfg.rollout.sleep_level
        if level:  # 0: the engines stay awake (a machine with memory to spare)
            roles.all(roles.engines, engine_method, **({"level": level} if engine_method == "sleep" else {}))
        moved = roles.all(roles.trainer, trainer_method)
        self.trainer_offloaded, self.engines_asleep = trainer_method == "offload", engine_method == "sleep" and level > 0
        if trainer_method == "offload" and roles.reference:
            moved += roles.all(roles.reference, "offload")
        self.switch_bytes[trainer_method] = sum(moved)

    def reference_logprobs(self, batch: TokenBatch, step: int, timed: bool = True):
        """`timed`: a phase of the step (`time/reference_logprobs`); StaleSync's producer, computing a batch's
        ahead on its own thread, passes False and traces the call on its own row."""
        if not self.roles.reference:
            return None
        with self.phase("reference logprobs", step) if timed else nullcontext():
            ref_logp, _, replies = self.roles.logprobs(self.roles.reference, self.put(batch))
        self.roles.all(self.roles.reference, "offload")
        self.trace_ranks("reference logprobs", self.roles.reference, replies, step)
        return ref_logp

    def trace_ranks(self, name: str, group, replies, step: int) -> None:
        dm = self.inputs.device_map
        for h, rep in zip(group, replies):
            if rep is not None:
                dev = dm.devices_of(h.role)[h.rank * (dm.ranks_per_engine if h.role == "rollout" else 1)]
                self.tracker.trace.add(name, f"device {dev}/{h.role} r{h.rank}", rep.start, rep.seconds, step)

    def evaluate(self, step: int) -> float:
        t0, self.at_step = time.time(), step
        with self.phase("evaluate", step):
            acc = heldout_accuracy(self.cfg, self.roles, self.inputs.tokenizer, self.inputs.heldout)
        self.eval_seconds[step] = time.time() - t0
        self.accuracy.append((step, acc))
        self.accuracy_seconds.append(round(time.time() - self.t0, 1))
        self.log(f"step {step}: held-out greedy accuracy {acc:.3f} ({len(self.inputs.heldout)} prompts)")
        return acc

    # --- checkpoints ---
    def checkpoint(self, step: int, force: bool = False) -> Path | None:
        c = self.cfg.checkpoint
        if not force and not (c.every_steps and step % c.every_steps == 0):
            return None
        d = step_dir(Path(c.dir), step)
        with self.phase("checkpoint", step):
            self.roles.all(self.roles.trainer, "save", str(d))
            commit(d, {"step": step, "version": step, "data": self.inputs.sampler.state_dict(), "rng": rng_state(),
                       "expert_load_prediction": self.load_prediction,
                       "expert_maps": [list(m) for m in self.expert_maps] if self.expert_maps else None,
                       "engine_experts": [list(m) for m in self.engine_experts] if self.engine_experts else None}
                   | (self.extra_state(d) if self.extra_state else {}))
            prune(Path(c.dir), c.keep_last)
        self.last_checkpoint = d
        return d

    def _resume(self, d: Path) -> None:
        state = json.loads((d / "driver.json").read_text())
        self.roles.all(self.roles.trainer, "load", str(d))
        self.inputs.sampler.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.load_prediction = state.get("expert_load_prediction")  # none in checkpoints written before it
        maps = state.get("expert_maps")  # the trainer ranks restored the same placement from their files
        engines = state.get("engine_experts")  # the engines take theirs with the sync below
        self._set_expert_maps(tuple(tuple(m) for m in maps) if maps else None,
                              tuple(tuple(m) for m in engines) if engines else None)
        self.step = state["step"]
        # the engines serve the resumed weights
        self.roles.sync_weights(self.inputs.sync, self.step, self.inputs.same_device)
        self.roles.all(self.roles.trainer, "offload")
        self.trainer_offloaded = True
        self.log(f"resumed from {d} at step {self.step}")

    def can_post_sync(self, step: int) -> bool:
        """Whether this step's sync may go out with its update (`Roles.submit_sync`): the engines can receive while
        the trainer updates (awake, or asleep on cpu, where it receives into staging buffers), and no expert
        migration comes between the two (it changes what is sent)."""
        b = self.cfg.trainer.expert_balance
        asleep = self.engines_asleep and self.cfg.placement.device_type is not DeviceType.cpu
        return not asleep and not (b.enabled and step % b.every_steps == 0)

    # --- faults: rlhf/driver/faults.py (Recovery) ---

    # --- metrics ---
    def record(self, step: int, ro: Rollout, batch: TokenBatch, entropy: torch.Tensor, parity: Parity,
               updates: list[UpdateReply], sync: SyncReplies, acc: float | None, seconds: float,
               extra: dict | None = None) -> None:
        cfg = self.cfg
        self.step = step
        problem = parity_problem(parity, run_parity_limit(cfg))
        if problem:
            self.parity_violations += 1
            self.log(f"step {step}: {problem}")
        link = replace(self.inputs.sync.topology, link_bytes_per_s=self.link_bytes_per_s or
                       self.inputs.sync.topology.link_bytes_per_s)
        m = step_metrics(ro, batch, entropy, parity, updates, sync, self.inputs.plan, link, seconds, self.switch_bytes)
        m.update(self.load_metrics)
        self.load_metrics = {}
        self.sync_seconds += self.phase_seconds.get("weight sync", m["time/sync"])  # what the loop waited
        self.step_seconds += seconds
        self.train_seconds += seconds - self.eval_seconds.get(step, 0.0)
        self.last_sync = sync
        m.update({f"time/{k.replace(' ', '_')}": v for k, v in self.phase_seconds.items()})
        m.update(extra or {})
        m["faults/engine_restarts"] = len(self.engine_restarts)
        m["faults/trainer_restarts"], m["faults/steps_redone"] = self.trainer_restarts, self.steps_redone
        self.phase_seconds = {}
        if acc is not None:
            m["accuracy/heldout"] = acc
        self.tracker.log(m, step)
        with (self.inputs.out / "steps.jsonl").open("a") as f:  # every metric of every step, readable as it runs
            f.write(json.dumps({"step": step} | m) + "\n")
        self.history.append({k: m[k] for k in ("reward/mean", "accuracy/train", "parity/max_abs_diff",
                                               "parity/mean_abs_diff", "parity/p99_abs_diff", "time/step",
                                               "time/sync", "time/sync_transfer",
                                               "time/sync_install", "sync/bytes_received", "sync/bytes_shm",
                                               "rollout/generated_tokens")}
                            | {"step": step, "samples": len(batch), "staleness_max": m.get("stale/staleness_max", 0),
                               "route_mismatch": m.get("route/mismatch"),
                               "ep_rank_load": m.get("expert_load/ep_rank_max_over_mean"),
                               "experts_moved": m.get("expert_balance/experts_moved", 0),
                               "expert_bytes_moved": m.get("expert_balance/bytes_moved", 0),
                               "engine_layers_replaced": m.get("expert_balance/engine_layers_replaced", 0),
                               "route_tokens_any_mismatch": m.get("route/tokens_any_mismatch")})
        self.progress.update(step, progress_fields(m, self.accuracy))

    def finish(self, acc_start: float) -> dict:
        cfg = self.cfg
        hf_dir = None
        if cfg.checkpoint.export_hf and self.history:
            d = self.last_checkpoint
            if d is None or not str(d).endswith(f"{self.step:06d}"):
                d = self.checkpoint(self.step, force=True)
            hf_dir = str(self.inputs.out / "hf")
            export_hf(d, cfg.model, hf_dir, tokenizer_dir=self.inputs.model_dir)
        self.progress.close()
        trace = self.tracker.trace.save()
        wandb_dir = self.tracker.finish()
        self.close()
        rewards = [h["reward/mean"] for h in self.history]
        k = max(1, len(rewards) // 4)
        result = {
            "steps": cfg.steps, "steps_run": len(self.history),
            "heldout_accuracy_start": acc_start, "heldout_accuracy_end": self.accuracy[-1][1],
            "heldout_accuracy_history": self.accuracy,
            "heldout_accuracy_seconds": self.accuracy_seconds,
            "reward_first_quarter": sum(rewards[:k]) / k if rewards else None,
            "reward_last_quarter": sum(rewards[-k:]) / k if rewards else None,
            "parity_max_abs_diff": max((h["parity/max_abs_diff"] for h in self.history), default=None),
            "parity_mean_abs_diff_max": max((h["parity/mean_abs_diff"] for h in self.history), default=None),
            "parity_p99_abs_diff_max": max((h["parity/p99_abs_diff"] for h in self.history), default=None),
            "parity_violations": self.parity_violations,
            # routing (rollout.capture_routes): the trainer's own top-k against the engine's, mean over steps
            "route_mismatch_mean": _mean((h["route_mismatch"] for h in self.history
                                          if h["route_mismatch"] is not None), 6),
            "route_tokens_any_mismatch_mean": _mean((h["route_tokens_any_mismatch"] for h in self.history
                                                     if h["route_tokens_any_mismatch"] is not None), 6),
            # expert-parallel load (tokens on the busiest EP rank over the mean, the worst MoE layer), mean over
            # steps; and what expert-load balancing moved (trainer.expert_balance)
            "ep_rank_load_max_over_mean_mean": _mean((h["ep_rank_load"] for h in self.history
                                                      if h["ep_rank_load"] is not None), 4),
            "expert_balance_experts_moved": sum(h["experts_moved"] for h in self.history),
            "expert_balance_bytes_moved": sum(h["expert_bytes_moved"] for h in self.history),
            # MoE layers whose engine placement followed (engines with ep > 1), summed over the balancing steps
            "expert_balance_engine_layers_replaced": sum(h["engine_layers_replaced"] for h in self.history),
            "syncs": len(self.history), "sync_bytes_per_step": self.inputs.plan.bytes_minimal,
            "sync_bytes_per_engine_rank": self._bytes_per_engine_rank(),
            "sync_bytes_minimal_per_engine_rank": [self.inputs.plan.bytes_into(r) for r in self._engine_ranks()],
            "sync_share": round(self.sync_seconds / self.step_seconds, 4) if self.step_seconds else None,
            "sync_seconds_mean": _mean(h["time/sync"] for h in self.history),
            "sync_transfer_seconds_mean": _mean(h["time/sync_transfer"] for h in self.history),
            "sync_install_seconds_mean": _mean(h["time/sync_install"] for h in self.history),
            "sync_link_gb_per_s": round(self.link_bytes_per_s / 1e9, 3),
            "ray_nodes": self.ray_nodes,
            # throughput over the steps' time, start-up and evaluation excluded
            "tokens_per_second": _ratio(sum(h["rollout/generated_tokens"] for h in self.history), self.train_seconds),
            "samples_per_second": _ratio(sum(h["samples"] for h in self.history), self.train_seconds),
            "seconds_per_step": _ratio(self.train_seconds, len(self.history)),
            "staleness_max": max((h["staleness_max"] for h in self.history), default=None),
            "samples_dropped": self.samples_dropped,
            "engine_restarts": len(self.engine_restarts), "trainer_restarts": self.trainer_restarts,
            "steps_redone": self.steps_redone,
            "seconds": round(time.time() - self.t0, 1),
            "wandb_dir": wandb_dir, "trace": trace, "hf_export": hf_dir,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
        (self.inputs.out / "result.json").write_text(json.dumps(result, indent=1))
        return result

    def _engine_ranks(self) -> list[int]:
        sync = self.inputs.sync
        return [r for k in range(sync.engines.engines) for r in sync.engine_ranks(k)]

    def _bytes_per_engine_rank(self) -> list[int] | None:
        """What each engine rank received in the last sync (network + shared memory), in rank order."""
        if self.last_sync is None:
            return None
        got = {r: b for rep in self.last_sync.receives for r, b in zip(rep.ranks, rep.bytes_per_rank)}
        return [got[r] for r in self._engine_ranks()]

    def close(self, failed: bool = False) -> None:
        if failed:
            self.tracker.finish(exit_code=1)  # the W&B run is marked failed (finish is idempotent)
        if self.roles is not None:
            self.roles.shutdown()
            self.roles = None
        if self.ray_owned:
            import ray

            ray.shutdown()
            self.ray_owned = False


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _mean(values, digits: int = 4) -> float | None:
    values = list(values)
    return round(sum(values) / len(values), digits) if values else None
