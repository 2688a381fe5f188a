"""The RL loop (`rlhf train RUN.yaml`): the single controller that calls the roles, step by step.

    rollouts (generate n per prompt, rewards) -> old logprobs (trainer) -> reference logprobs
    -> advantages -> policy update (mini-batches x epochs) -> weight sync (checksum verified)

Co-located roles switch around the update: engines sleep and the trainer onloads before it; the
trainer offloads and the engines wake after the sync (on cpu vLLM has no sleep: a logged no-op with
the same protocol). The driver moves references and small tensors; weights move trainer -> engine
directly (`weight_sync`).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from rlhf.algorithms.objective import advantages, kl_reward_penalty
from rlhf.batch import TokenBatch
from rlhf.config.load import as_dict
from rlhf.config.schema import RunConfig
from rlhf.parity import logprob_parity
from rlhf.rollout import Rollout, collect, heldout_accuracy


def train(cfg: RunConfig, log=lambda m: print(m, file=sys.stderr, flush=True)) -> dict:
    run = RunState.start(cfg, log)
    try:
        roles, acc_start = run.roles, run.evaluate(run.step)
        for step in range(run.step + 1, cfg.steps + 1):
            t_step = time.time()
            with run.phase("rollout", step):
                ro = collect(cfg, roles, run.sampler, run.tok, step)
            batch = run.token_batch(ro)
            with run.phase("switch to training", step):
                run.switch("sleep", "onload", step)
            with run.phase("old logprobs", step):
                old_logp, entropy, replies = roles.logprobs(roles.trainer, run.put(batch))
            run.trace_ranks("old logprobs", roles.trainer, replies, step)
            ref_logp = run.reference_logprobs(batch, step)
            rewards_PG = ro.rewards_PG
            if cfg.algorithm.kl_in_reward and ref_logp is not None:
                rewards_PG = rewards_PG - kl_reward_penalty(cfg.algorithm, old_logp, ref_logp, batch.mask_BT).view_as(rewards_PG)
            batch = batch.with_(advantages_B=advantages(cfg.algorithm, rewards_PG), old_logp_BT=old_logp,
                                ref_logp_BT=ref_logp)
            with run.phase("update", step):
                updates = roles.all(roles.trainer, "update", run.put(batch), run.mini_batches(len(batch), step))
            run.trace_ranks("update", roles.trainer, updates, step)
            with run.phase("weight sync", step):
                sync = roles.sync_weights(run.sync_layout, step, run.same_device)
            run.trace_ranks("weight sync", roles.trainer + roles.engines, sync, step)
            with run.phase("switch to rollout", step):
                run.switch("wake_up", "offload", step)
            acc = run.evaluate(step) if step % cfg.eval_every == 0 or step == cfg.steps else None
            run.checkpoint(step)
            parity = logprob_parity(old_logp, batch.rollout_logp_BT, batch.mask_BT)
            run.record(step, ro, batch, entropy, parity, updates, sync, acc, time.time() - t_step)
        return run.finish(acc_start)
    except BaseException:
        run.close(failed=True)
        raise


class RunState:
    """Everything around the loop: setup, evaluation, stage switching, checkpoints, metrics."""

    @staticmethod
    def start(cfg: RunConfig, log) -> "RunState":
        self = RunState()
        self.cfg, self.log, self.t0 = cfg, log, time.time()
        self.roles, self.ray_owned, self.last_checkpoint, self.tracker = None, False, None, None
        self.switch_bytes: dict[str, int] = {}
        try:
            self._setup(cfg, log)
        except BaseException:  # an actor that failed to start: stop what did start, and Ray if we started it
            self.close(failed=True)
            raise
        return self

    def _setup(self, cfg: RunConfig, log) -> None:
        from actors.roles import Roles, connect
        from rlhf.checkpoint import resolve_resume
        from rlhf.data.prompts import load_prompts
        from rlhf.data.sampler import PromptSampler
        from rlhf.data.tokenizer import load_tokenizer
        from rlhf.evaluate import check_model_dir
        from rlhf.placement import device_map
        from rlhf.tracking import Progress, Trace, Tracker
        from weight_sync.engine_sync import SyncLayout
        from weight_sync.layout import Layout

        # everything that can be wrong with the inputs fails here, before any actor starts
        self.model_dir = str(check_model_dir(cfg))
        self.dm = device_map(cfg)
        self.tok = load_tokenizer(self.model_dir)
        d = cfg.data
        train_rows = load_prompts(d.train_files, d.prompt_key, d.answer_key, d.skip_bad_rows)
        self.heldout = load_prompts(d.heldout_files, d.prompt_key, d.answer_key, d.skip_bad_rows).rows
        self.sampler = PromptSampler(train_rows.rows, d.prompts_per_step, cfg.seed, d.shuffle)
        resume_dir = resolve_resume(Path(cfg.checkpoint.dir), cfg.checkpoint.resume)
        t = cfg.trainer
        layout = Layout(pp=t.pp, dp=t.dp, tp=t.tp, ep=t.ep, experts_over_tp_ep=t.experts_over_tp_ep)
        self.sync_layout = SyncLayout(cfg.model, layout, cfg.rollout.num_engines, self._sync_topology(layout),
                                      cfg.trainer.zero_stage)
        self.plan = self.sync_layout.plan()  # validated before any actor starts
        # Co-located trainer ranks and engine hosts exchange through shared memory (cpu; the CUDA / NPU IPC
        # path of weight_sync.shm is not yet tested on devices, so there the group carries everything).
        self.same_device = (self.sync_layout.same_device_pairs(self.transfer_devices)
                            if cfg.placement.device_type.value == "cpu" else frozenset())
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):  # set by `ray job submit` for the job's driver
            rel = [k for k, v in (("output_dir", cfg.output_dir), ("tracking.dir", cfg.tracking.dir),
                                  ("checkpoint.dir", cfg.checkpoint.dir)) if not Path(v).is_absolute()]
            if rel:
                log(f"warning: {', '.join(rel)} relative in a Ray job: written into the job's temporary copy of "
                    "the working dir and lost when it ends; pass absolute paths")
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

        self.phase_seconds: dict[str, float] = {}
        self.tracker = Tracker(cfg.tracking, as_dict(cfg))
        self.tracker.trace = Trace(self.out / "trace.json", enabled=cfg.tracking.trace)
        self.ray_owned = connect(cfg.placement, log)
        with self.phase("start roles", 0):
            self.roles = Roles.start(cfg, self.dm, self.model_dir, self.sync_layout, log)
        self.step, self.version = 0, 0
        if resume_dir is not None:
            self._resume(resume_dir)
        self.progress = Progress(cfg.steps, start_step=self.step)
        self.history: list[dict] = []
        self.accuracy: list[tuple[int, float]] = []
        self.parity_violations = 0
        log(f"train: {cfg.steps} steps from step {self.step}; trainer {layout} on devices {self.dm.devices_of('trainer')}, "
            f"{cfg.rollout.num_engines} engine(s) on {self.dm.devices_of('rollout')}; sync plan "
            f"{self.plan.bytes_minimal / 1e6:.2f} MB per step")

    def _sync_topology(self, layout):
        """Nodes of the transfer ranks: the trainer ranks, then each engine host (its first device)."""
        from weight_sync.plan import Topology

        p = self.cfg.placement
        devices = list(self.dm.devices_of("trainer"))
        rpe = self.dm.ranks_per_engine
        devices += [self.dm.devices_of("rollout")[k * rpe] for k in range(self.cfg.rollout.num_engines)]
        self.transfer_devices = tuple(devices)
        return Topology(f"{p.nodes}x{p.devices_per_node} {p.device_type.value}",
                        tuple(self.dm.node_of(d) for d in devices), p.fabric_gbytes_per_s * 1e9)

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

    def token_batch(self, ro: Rollout) -> TokenBatch:
        G = self.cfg.algorithm.group_size
        prompts = [ro.prompt_ids[i // G] for i in range(len(ro.completions))]
        return TokenBatch.from_samples(prompts, [c.token_ids for c in ro.completions],
                                       [c.logp for c in ro.completions], self.cfg.model.pad_token_id,
                                       self.cfg.rollout.temperature)

    def mini_batches(self, n: int, step: int) -> list[list[int]]:
        """Sample indices of each mini-batch, shuffled per step (the same list goes to every rank)."""
        order = list(range(n))
        random.Random(self.cfg.seed * 7919 + step).shuffle(order)
        size = min(self.cfg.trainer.mini_batch_size, n)
        return [order[i:i + size] for i in range(0, n, size)]

    def switch(self, engine_method: str, trainer_method: str, step: int) -> None:
        """Co-location: engines sleep / wake, trainer and reference onload / offload."""
        roles = self.roles
        roles.all(roles.engines, engine_method)
        moved = roles.all(roles.trainer, trainer_method)
        if trainer_method == "offload" and roles.reference:
            moved += roles.all(roles.reference, "offload")
        self.switch_bytes[trainer_method] = sum(moved)

    def reference_logprobs(self, batch: TokenBatch, step: int):
        if not self.roles.reference:
            return None
        with self.phase("reference logprobs", step):
            ref_logp, _, replies = self.roles.logprobs(self.roles.reference, self.put(batch))
        self.roles.all(self.roles.reference, "offload")
        self.trace_ranks("reference logprobs", self.roles.reference, replies, step)
        return ref_logp

    def trace_ranks(self, name: str, group, replies, step: int) -> None:
        for h, rep in zip(group, replies):
            if rep is not None:
                dev = self.dm.devices_of(h.role)[h.rank * (self.dm.ranks_per_engine if h.role == "rollout" else 1)]
                self.tracker.trace.add(name, f"device {dev}/{h.role} r{h.rank}", rep["start"], rep["seconds"], step)

    def evaluate(self, step: int) -> float:
        with self.phase("evaluate", step):
            acc = heldout_accuracy(self.cfg, self.roles, self.tok, self.heldout)
        self.accuracy.append((step, acc))
        self.log(f"step {step}: held-out greedy accuracy {acc:.3f} ({len(self.heldout)} prompts)")
        return acc

    # --- checkpoints ---
    def checkpoint(self, step: int, force: bool = False) -> Path | None:
        from rlhf.checkpoint import commit, prune, rng_state, step_dir

        c = self.cfg.checkpoint
        if not force and not (c.every_steps and step % c.every_steps == 0):
            return None
        d = step_dir(Path(c.dir), step)
        with self.phase("checkpoint", step):
            self.roles.all(self.roles.trainer, "save", str(d))
            commit(d, {"step": step, "version": step, "data": self.sampler.state_dict(), "rng": rng_state()})
            prune(Path(c.dir), c.keep_last)
        self.last_checkpoint = d
        return d

    def _resume(self, d: Path) -> None:
        from rlhf.checkpoint import set_rng_state

        state = json.loads((d / "driver.json").read_text())
        self.roles.all(self.roles.trainer, "load", str(d))
        self.sampler.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        self.step = self.version = state["step"]
        self.roles.sync_weights(self.sync_layout, self.version, self.same_device)  # the engines serve the resumed weights
        self.roles.all(self.roles.trainer, "offload")
        self.log(f"resumed from {d} at step {self.step}")

    # --- metrics ---
    def record(self, step, ro: Rollout, batch: TokenBatch, entropy, parity, updates, sync, acc, seconds) -> None:
        cfg, W = self.cfg, self.sync_layout.trainer.world_size
        self.version = step
        if parity.max_abs_diff > cfg.rollout.parity_max_abs:
            self.parity_violations += 1
            self.log(f"step {step}: trainer/engine logprob parity {parity.max_abs_diff:.2e} exceeds "
                     f"rollout.parity_max_abs={cfg.rollout.parity_max_abs:g}")
        trainer_sync, engine_sync = sync[:W], sync[W:]
        sync_s = max(r["seconds"] for r in sync)
        lengths = torch.tensor([len(c.token_ids) for c in ro.completions], dtype=torch.float32)
        m = {
            "reward/mean": float(ro.rewards_PG.mean()), "reward/std": float(ro.rewards_PG.std()),
            "accuracy/train": float(ro.scores_PG.mean()),
            "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
            "response/truncated_fraction": sum(c.finish_reason == "length" for c in ro.completions) / len(ro.completions),
            "rollout/groups_drawn": ro.groups_drawn, "rollout/groups_kept": len(ro.rows),
            "actor/entropy_old": float((entropy * batch.mask_BT).sum() / batch.mask_BT.sum()),
            "parity/max_abs_diff": parity.max_abs_diff, "parity/mean_abs_diff": parity.mean_abs_diff,
            "time/generate": ro.generate_seconds, "time/reward": ro.reward_seconds, "time/step": seconds,
            "time/sync": sync_s, "time/sync_transfer": max(r["transfer_seconds"] for r in engine_sync),
            "time/sync_install": max(r["install_seconds"] for r in engine_sync),
            "time/update": max(u["seconds"] for u in updates),
            "sync/bytes_minimal": self.plan.bytes_minimal, "sync/bytes_network": self.plan.bytes_network,
            "sync/bytes_local": self.plan.bytes_local,
            "sync/bytes_received": sum(r["bytes_received"] for r in engine_sync),
            "sync/bytes_shm": sum(r["bytes_shm"] for r in engine_sync),
            "sync/bytes_in_place": sum(r["bytes_in_place"] for r in engine_sync),
            "sync/bytes_sent": sum(r["bytes_sent"] for r in trainer_sync),
            "sync/gb_per_s": self.plan.bytes_network / max(sync_s, 1e-9) / 1e9,
            "sync/floor_seconds": self.plan.floor_seconds(self.sync_layout.topology),
            "sync/checked_transfers": sum(r["checked_transfers"] for r in engine_sync),
            "sync/version": step,
            "throughput/generate_tokens_per_s": ro.generated_tokens / max(ro.generate_seconds, 1e-9),
            "throughput/step_tokens_per_s": float(batch.attention_mask_BT.sum()) / seconds,
            "offload/bytes": self.switch_bytes.get("offload", 0), "onload/bytes": self.switch_bytes.get("onload", 0),
        }
        m.update(_update_stats(updates, self.cfg.trainer))
        m.update(_expert_load(updates))
        m.update({f"time/{k.replace(' ', '_')}": v for k, v in self.phase_seconds.items()})
        self.phase_seconds = {}
        if acc is not None:
            m["accuracy/heldout"] = acc
        self.tracker.log(m, step)
        self.history.append({k: m[k] for k in ("reward/mean", "accuracy/train", "parity/max_abs_diff",
                                               "parity/mean_abs_diff", "time/step",
                                               "time/sync", "sync/bytes_received", "sync/bytes_shm")} | {"step": step})
        self.progress.update(step, {"reward": m["reward/mean"], "acc": acc if acc is not None else float("nan"),
                                    "sync_MB": (m["sync/bytes_received"] + m["sync/bytes_shm"]) / 1e6})

    def finish(self, acc_start: float) -> dict:
        from rlhf.checkpoint import export_hf

        cfg = self.cfg
        hf_dir = None
        if cfg.checkpoint.export_hf and self.history:
            d = self.last_checkpoint
            if d is None or not str(d).endswith(f"{self.version:06d}"):
                d = self.checkpoint(self.version, force=True)
            hf_dir = str(self.out / "hf")
            export_hf(d, cfg.model, hf_dir, tokenizer_dir=self.model_dir)
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
            "reward_first_quarter": sum(rewards[:k]) / k if rewards else None,
            "reward_last_quarter": sum(rewards[-k:]) / k if rewards else None,
            "parity_max_abs_diff": max((h["parity/max_abs_diff"] for h in self.history), default=None),
            "parity_mean_abs_diff_max": max((h["parity/mean_abs_diff"] for h in self.history), default=None),
            "parity_violations": self.parity_violations,
            "syncs": len(self.history), "sync_bytes_per_step": self.plan.bytes_minimal,
            "seconds": round(time.time() - self.t0, 1),
            "wandb_dir": wandb_dir, "trace": trace, "hf_export": hf_dir,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
        (self.out / "result.json").write_text(json.dumps(result, indent=1))
        return result

    def close(self, failed: bool = False) -> None:
        if failed and self.tracker is not None:
            self.tracker.finish(exit_code=1)  # the W&B run is marked failed (finish is idempotent)
        roles = self.roles
        if roles is not None:
            roles.shutdown()
            self.roles = None
        if self.ray_owned:
            import ray

            ray.shutdown()
            self.ray_owned = False


def _update_stats(updates: list[dict], tcfg) -> dict:
    """Combine the trainer ranks' token-weighted sums; each DP index counted once (TP / PP copies agree)."""
    per_rank = [u["stats"] for u in updates]
    tokens = sum(s["tokens"] for s in per_rank) or 1.0
    out = {f"actor/{k}": sum(s[k] * s["tokens"] for s in per_rank) / tokens
           for k in ("clip_fraction", "ratio_mean", "kl", "entropy")}
    out["actor/loss"] = per_rank[0]["loss"]
    out["actor/grad_norm"] = per_rank[0]["grad_norm"]
    out["actor/optimizer_steps"] = per_rank[0]["optimizer_steps"]
    out["actor/lr"] = per_rank[0]["lr"]
    return out


def _expert_load(updates: list[dict]) -> dict:
    """Per MoE layer: tokens of the busiest expert over the mean (1.0 is perfectly balanced)."""
    stats = [u["router"] for u in updates if u.get("router")]
    if not stats:
        return {}
    load = torch.tensor(stats[0], dtype=torch.float64)
    out = {f"expert_load/layer{i}_max_over_mean": float(row.max() / row.mean().clamp(min=1e-9))
           for i, row in enumerate(load)}
    out["expert_load/max_over_mean"] = max(out.values())
    return out

