"""A run's state around the loop: its inputs, checked before any actor starts (`RunInputs`), and the run
itself (`Run`): its roles, where it stands, and its components, each with one job and built by the run:

    Recorder        each step's metrics, the driver's phases, the accuracy history, the result (`record`)
    WeightSync      the layout and plan the weights go to the engines by; follows expert moves
    Colocation      whose turn it is on devices the trainer and the engines share
    ExpertBalance   the expert-load prediction and the placements it leads to (`expert_balance`)
    Faults          dead or hung processes replaced, restarts counted, chaos injected (`faults`)

and the pieces of a step the loop (`loop`) and the learning half (`step`) call.
"""

from __future__ import annotations

import json
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

import torch

from actors.replies import SyncReplies
from actors.roles import Roles, connect
from rlhf.batch import TokenBatch
from rlhf.checkpoint import (commit, export_hf, fresh_run_problem, prune, queued_groups_problem, resolve_resume,
                             rng_state, set_rng_state, step_dir)
from rlhf.config.load import as_dict
from rlhf.cpu_matmul import compute_dtype_problem
from rlhf.data.prompts import DatasetError, PromptRow, fit_context, load_prompts, valid_answers
from rlhf.data.sandbox import parse_tests
from rlhf.data.sandbox_box import isolation_problem
from rlhf.data.sampler import PromptSampler
from rlhf.data.tokenizer import load_tokenizer
from rlhf.driver.expert_balance import ExpertBalance
from rlhf.driver.faults import Faults
from rlhf.driver.metrics import step_metrics
from rlhf.driver.record import Recorder
from rlhf.driver.rollout import Rollout, heldout_accuracy
from rlhf.errors import ConfigError
from rlhf.leftovers import release_programs
from rlhf.model.hf_io import check_model_dir
from rlhf.moe.routing import RouteFetch
from rlhf.parity import Parity, parity_problem, run_parity_limit
from rlhf.placement import DeviceMap, device_map
from rlhf.placement.transfer import sync_layout
from rlhf.sharding.sync import SyncLayout
from rlhf.schema import DeviceType, RewardKind, RunConfig, SandboxIsolation
from rlhf.sim.workload import attention_quadratic
from rlhf.tiny import make_tiny_args
from rlhf.tracking import Trace, Tracker
from weight_sync.plan import Plan, Topology

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
        problem = compute_dtype_problem(cfg.model, cfg.trainer, dm.device_type)  # the driver's machine; each rank
        if problem:  # checks its own
            raise ConfigError(problem)
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
        if cfg.reward.kind is RewardKind.code:
            sandbox = cfg.reward.sandbox
            problem = isolation_problem(sandbox)  # the driver's machine; each reward worker checks its own
            if problem:
                raise ConfigError(problem)
            if sandbox.isolation is SandboxIsolation.process:
                log("warning: reward.sandbox.isolation=process: the policy's programs run without the box; they can "
                    "read what the reward workers' user can and reach the network (docs/security.md)")
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
class WeightSync:
    """The weights' way from the trainer to the engines: the sync layout and its plan (both follow the expert
    placements when experts move: `follow`), the co-located rank pairs, and the link measured at start."""

    layout: SyncLayout
    plan: Plan
    same_device: frozenset[tuple[int, int]]
    link_bytes_per_s: float = 0.0

    def send(self, roles: Roles, version: int, posted=None) -> SyncReplies:
        """Install `version` in every engine (`posted`: the sync's calls, sent with the update)."""
        return roles.sync_weights(self.layout, version, self.same_device, posted)

    def post(self, roles: Roles, version: int) -> tuple:
        """The sync's calls sent now, to run behind the trainer's update (`Roles.submit_sync`)."""
        return roles.submit_sync(self.layout, version, self.same_device, posted=True)

    def follow(self, expert_maps, engine_experts, roles: Optional[Roles]) -> None:
        self.layout = replace(self.layout, expert_maps=expert_maps, engine_experts=engine_experts)
        self.plan = self.layout.plan()
        if roles is not None:
            roles.follow_layout(self.layout)

    def link(self) -> Topology:
        """The topology with the link as measured (the floor's bandwidth)."""
        return replace(self.layout.topology, link_bytes_per_s=self.link_bytes_per_s or
                       self.layout.topology.link_bytes_per_s)

    def engine_ranks(self) -> list[int]:
        return [r for k in range(self.layout.engines.engines) for r in self.layout.engine_ranks(k)]

    def bytes_per_engine_rank(self, last: Optional[SyncReplies]) -> list[int] | None:
        """What each engine rank received in sync `last` (network + shared memory), in rank order."""
        if last is None:
            return None
        got = {r: b for rep in last.receives for r, b in zip(rep.ranks, rep.bytes_per_rank)}
        return [got[r] for r in self.engine_ranks()]


@dataclass
class Colocation:
    """Whose turn it is on devices the trainer and the engines share: engines asleep or awake, the trainer's
    state on the device or in host memory, and the bytes the last switch moved."""

    sleep_level: int  # rollout.sleep_level; 0: the engines stay awake
    trainer_offloaded: bool = False  # the trainer's state is in host memory (engines' turn)
    engines_asleep: bool = False  # the engines released their memory (trainer's turn)
    switch_bytes: dict[str, int] = field(default_factory=dict)  # bytes moved by the last onload / offload

    def switch(self, roles: Roles, engine_method: str, trainer_method: str) -> None:
        """Engines sleep / wake, trainer and reference onload / offload."""
        level = self.sleep_level
        if level:
            roles.all(roles.engines, engine_method, **({"level": level} if engine_method == "sleep" else {}))
        moved = roles.all(roles.trainer, trainer_method)
        self.trainer_offloaded, self.engines_asleep = trainer_method == "offload", engine_method == "sleep" and level > 0
        if trainer_method == "offload" and roles.reference:
            moved += roles.all(roles.reference, "offload")
        self.switch_bytes[trainer_method] = sum(moved)

    def offloaded(self) -> None:
        self.trainer_offloaded = True

    def wake_engines(self, roles: Roles) -> None:
        if self.engines_asleep:
            roles.all(roles.engines, "wake_up")
            self.engines_asleep = False


@dataclass
class Run:
    """One run: its inputs, its roles once started, where it stands, and its components (each with one job)."""

    cfg: RunConfig
    inputs: RunInputs
    log: Log
    recorder: Recorder  # each step's metrics, the phases, the accuracy history, the result
    weights: WeightSync  # the layout and plan the engines get the weights by
    devices: Colocation
    source: object  # where the loop's batches come from (rlhf.driver.sources.RolloutSource): its checkpoint state
    experts: ExpertBalance = None  # type: ignore[assignment]  # built with the run (`__post_init__`)
    faults: Faults = None  # type: ignore[assignment]
    roles: Optional[Roles] = None
    ray_owned: bool = False  # this process started Ray, so it stops it
    step: int = 0  # the last step done (the weights' version)
    at_step: int = 0  # the step in progress (or the one just evaluated): where faults are counted and injected
    last_checkpoint: Optional[Path] = None
    ray_nodes: list[str] = field(default_factory=list)  # the Ray node of each placement node

    def __post_init__(self):
        self.experts = ExpertBalance(self.cfg, self.weights, self.log, self.recorder.phase)
        self.faults = Faults(self, wake=self.source.wake)

    @staticmethod
    def start(cfg: RunConfig, log: Log, source) -> "Run":
        """Check every input, then start Ray and the roles (stopped again if anything fails). `source`: the
        rollout source the loop will take batches from."""
        inputs = RunInputs.prepare(cfg, log)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        tracker = Tracker(cfg.tracking, as_dict(cfg))
        tracker.trace = Trace(inputs.out / "trace.json", enabled=cfg.tracking.trace)
        run = Run(cfg, inputs, log, Recorder(tracker, inputs.out / "steps.jsonl", cfg.steps),
                  WeightSync(inputs.sync, inputs.plan, inputs.same_device), Colocation(cfg.rollout.sleep_level),
                  source)
        if inputs.resume_dir is None:  # a new run's steps.jsonl starts empty; a resumed run appends
            (inputs.out / "steps.jsonl").unlink(missing_ok=True)
        try:
            run.ray_owned = connect(cfg.placement, log)
            with run.phase("start roles", 0):
                run.roles = Roles.start(cfg, inputs.device_map, inputs.model_dir, inputs.sync, log,
                                        shm_record=inputs.out / ENGINE_SHM_RECORD,
                                        recover=run.faults.recover_engines, inject=run.faults.inject)
            run.weights.link_bytes_per_s = run.roles.link_probe(inputs.sync)
            run.ray_nodes = run.roles.ray_nodes()
            if inputs.resume_dir is not None:
                run.resume(inputs.resume_dir)
        except BaseException:  # an actor that failed to start: stop what did start, and Ray if we started it
            run.close(failed=True)
            raise
        run.recorder.begin(run.step)
        dm = inputs.device_map
        log(f"train: {cfg.steps} steps from step {run.step}; trainer {inputs.sync.trainer} on devices "
            f"{dm.devices_of('trainer')}, {cfg.rollout.num_engines} engine(s) on {dm.devices_of('rollout')}; "
            f"sync plan {inputs.plan.bytes_minimal / 1e6:.2f} MB per step to {inputs.sync.engines.world_size} engine "
            f"rank(s), link measured at {run.weights.link_bytes_per_s / 1e9:.2f} GB/s")
        return run

    # --- pieces of a step ---
    def begin(self, step: int) -> None:
        """Step `step` is under way: faults are counted and chaos injected at it."""
        self.at_step = step

    def phase(self, name: str, step: int):
        """Time a driver phase: a trace event and the step's `time/<phase>` metric."""
        return self.recorder.phase(name, step)

    @property
    def trace(self) -> Trace:
        return self.recorder.tracker.trace

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
        stored = sum(r.nbytes(L, m.num_experts_per_tok) for r in refs if r is not None)
        return per_rank, {"route/bytes_sent": sum(sizes), "route/bytes_per_rank_max": max(sizes),
                          "route/bytes_stored": stored}

    def token_batch(self, ro: Rollout) -> TokenBatch:
        G = self.cfg.algorithm.group_size
        prompts = [ro.prompt_ids[i // G] for i in range(len(ro.completions))]
        masks = None  # episodes: observation tokens are read, not trained on
        if any(c.loss_mask for c in ro.completions):
            masks = [list(c.loss_mask) or [1] * len(c.token_ids) for c in ro.completions]
        return TokenBatch.from_samples(prompts, [c.token_ids for c in ro.completions],
                                       [c.logp for c in ro.completions], self.cfg.model.pad_token_id,
                                       self.cfg.rollout.temperature,  # routes go apart (`route_shares`)
                                       loss_masks=masks).with_(attention_cost=attention_quadratic(self.cfg.model))

    def mini_batches(self, n: int, step: int) -> list[list[int]]:
        """Sample indices of each mini-batch, shuffled per step (the same list goes to every rank)."""
        order = list(range(n))
        random.Random(self.cfg.seed * 7919 + step).shuffle(order)
        size = min(self.cfg.trainer.mini_batch_size, n)
        return [order[i:i + size] for i in range(0, n, size)]

    def switch(self, engine_method: str, trainer_method: str) -> None:
        """Co-location: engines sleep / wake, trainer and reference onload / offload."""
        self.devices.switch(self.roles, engine_method, trainer_method)

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
                self.trace.add(name, f"device {dev}/{h.role} r{h.rank}", rep.start, rep.seconds, step)

    def evaluate(self, step: int) -> float:
        t0, self.at_step = time.time(), step
        with self.phase("evaluate", step):
            acc = heldout_accuracy(self.cfg, self.roles, self.inputs.tokenizer, self.inputs.heldout)
        self.recorder.evaluated(step, acc, time.time() - t0)
        self.log(f"step {step}: held-out greedy accuracy {acc:.3f} ({len(self.inputs.heldout)} prompts)")
        return acc

    def sync_weights(self, version: int, posted=None) -> SyncReplies:
        """The weight sync of `version` to every engine, dead or hung engines replaced (`Faults.sync_weights`)."""
        return self.faults.sync_weights(version, posted)

    def can_post_sync(self, step: int) -> bool:
        """Whether this step's sync may go out with its update (`Roles.submit_sync`): the engines can receive while
        the trainer updates (awake, or asleep on cpu, where it receives into staging buffers), and no expert
        migration comes between the two (it changes what is sent)."""
        b = self.cfg.trainer.expert_balance
        asleep = self.devices.engines_asleep and self.cfg.placement.device_type is not DeviceType.cpu
        return not asleep and not (b.enabled and step % b.every_steps == 0)

    # --- checkpoints ---
    def checkpoint_due(self, step: int) -> bool:
        c = self.cfg.checkpoint
        return bool(c.every_steps) and step % c.every_steps == 0

    def checkpoint(self, step: int) -> Path:
        """The trainer's state, the data cursor, the RNG, the expert placements and the rollout source's state
        (StaleSync: its queue) in a complete step directory; the oldest pruned past checkpoint.keep_last."""
        c = self.cfg.checkpoint
        d = step_dir(Path(c.dir), step)
        with self.phase("checkpoint", step):
            self.roles.all(self.roles.trainer, "save", str(d))
            commit(d, {"step": step, "version": step, "data": self.inputs.sampler.state_dict(), "rng": rng_state()}
                   | self.experts.state() | self.source.state(d))
            prune(Path(c.dir), c.keep_last)
        self.last_checkpoint = d
        return d

    def resume(self, d: Path) -> None:
        """Checkpoint `d` restored: the trainer's state, the data cursor, the RNG and the expert placements, and
        its weights installed in every engine; the trainer offloaded (the engines' turn)."""
        state = json.loads((d / "driver.json").read_text())
        self.roles.all(self.roles.trainer, "load", str(d))
        self.inputs.sampler.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.experts.restore(state, self.roles)
        self.step = state["step"]
        self.weights.send(self.roles, self.step)  # the engines serve the resumed weights
        self.roles.all(self.roles.trainer, "offload")
        self.devices.offloaded()
        self.log(f"resumed from {d} at step {self.step}")

    # --- metrics ---
    def record(self, step: int, ro: Rollout, learned, parity: Parity, acc: float | None, seconds: float,
               extra: dict) -> None:
        """Step `step` done: its metrics from the rollouts, what training made of them (`step.Learned`), the
        trainer/engine parity, the held-out accuracy if evaluated, and the rollout source's own metrics."""
        self.step = step
        problem = parity_problem(parity, run_parity_limit(self.cfg))
        if problem:
            self.log(f"step {step}: {problem}")
        m = step_metrics(ro, learned.batch, learned.entropy, parity, learned.updates, learned.sync, self.weights.plan,
                         self.weights.link(), seconds, self.devices.switch_bytes)
        m.update(self.experts.take_metrics())
        m.update(extra)
        m.update(self.faults.metrics())
        if acc is not None:
            m["accuracy/heldout"] = acc
        self.recorder.add(step, m, seconds, len(learned.batch), problem, learned.sync)

    def finish(self, acc_start: float) -> dict:
        """The run's end: the HF export if asked (from a checkpoint of the last step), the trace and the W&B
        run closed, the roles stopped; the result, also in result.json."""
        cfg, rec = self.cfg, self.recorder
        hf_dir = None
        if cfg.checkpoint.export_hf and rec.history:
            d = self.last_checkpoint
            if d is None or not str(d).endswith(f"{self.step:06d}"):
                d = self.checkpoint(self.step)
            hf_dir = str(self.inputs.out / "hf")
            export_hf(d, cfg.model, hf_dir, tokenizer_dir=self.inputs.model_dir)
        rec.progress.close()
        trace = rec.tracker.trace.save()
        wandb_dir = rec.tracker.finish()
        self.close()
        w = self.weights
        result = rec.result(acc_start) | {
            "sync_bytes_per_step": w.plan.bytes_minimal,
            "sync_bytes_per_engine_rank": w.bytes_per_engine_rank(rec.last_sync),
            "sync_bytes_minimal_per_engine_rank": [w.plan.bytes_into(r) for r in w.engine_ranks()],
            "sync_link_gb_per_s": round(w.link_bytes_per_s / 1e9, 3), "ray_nodes": self.ray_nodes,
            "engine_restarts": len(self.faults.engine_restarts), "trainer_restarts": self.faults.trainer_restarts,
            "steps_redone": self.faults.steps_redone,
            "wandb_dir": wandb_dir, "trace": trace, "hf_export": hf_dir,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        } | self.source.result()
        (self.inputs.out / "result.json").write_text(json.dumps(result, indent=1))
        return result

    def close(self, failed: bool = False) -> None:
        if failed:
            self.recorder.tracker.finish(exit_code=1)  # the W&B run is marked failed (finish is idempotent)
        if self.roles is not None:
            self.roles.shutdown()
            self.roles = None
        release_programs()  # the held-out evaluation's programs, run in this process
        if self.ray_owned:
            import ray

            ray.shutdown()
            self.ray_owned = False
