"""A run's roles on Ray: started where the placement says, wired into their groups, and the fan-out
calls the driver makes on each (every call deadline-bound; a failure names role and rank).

  trainer     `TrainerWorker` x (pp * dp * tp), one torch.distributed group
  reference   `PolicyWorker` x the same layout, its own group (only when the KL term needs it)
  rollout     `VLLMEngine` x num_engines
  reward      `RuleRewardWorker` (rule verifiers) or `RewardModelWorker` (kind: model) x reward.workers
  weight sync trainer ranks + engine hosts in one point-to-point group (`weight_sync.group`)

Each device is a bundle of a per-node STRICT_PACK placement group; a role rank asks for its device's
bundle and a share of it (`rlhf.placement.actor_options`), so co-located roles fit together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Sequence

from actors.remote import RoleHandle, call_all, spawn
from actors.replies import LogprobsReply, ScoreReply, SyncReplies
from rlhf.data.sampler import prompt_seed
from rlhf.schema import RewardKind, RoutingReplay, RunConfig

START_TIMEOUT_S = 900.0  # vLLM start (30-40 s here; longer on a cold compile cache) and model loading


@dataclass
class Roles:
    trainer: list[RoleHandle]
    reference: list[RoleHandle]
    engines: list[RoleHandle]
    rewards: list[RoleHandle]
    placement_groups: list
    timeout_s: float

    @staticmethod
    def start(cfg: RunConfig, dm, model_dir: str, sync_layout, log=print, name_prefix: str = "") -> "Roles":
        import ray
        from ray.util.placement_group import placement_group

        from actors.reward import RewardModelWorker, RuleRewardWorker
        from actors.trainer_worker import PolicyWorker, TrainerWorker
        from actors.vllm_engine import VLLMEngine
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
        trainer = [spawn(TrainerWorker, "trainer", r, cfg.model, cfg.trainer, cfg.algorithm, dt, r, model_dir,
                         **slot("trainer", r)) for r in range(W)]
        ref_trainer = replace(cfg.trainer, routing_replay=RoutingReplay.off)  # the policy's routes are not its own
        reference = [spawn(PolicyWorker, "reference", r, cfg.model, ref_trainer, dt, r, model_dir,
                           **slot("reference", r)) for r in range(W)] if "reference" in dm.role_names else []
        rpe = dm.ranks_per_engine
        # partial rollouts: a sync's install runs on a second thread while the generation parks between steps
        # (a third for an evaluation waiting its turn)
        partial = cfg.stale_sync.partial_rollout
        engines = [spawn(VLLMEngine, "rollout", k, model_dir, cfg.rollout, dt, seed=cfg.seed + k,
                         max_model_len=cfg.model.max_position_embeddings,
                         cpu_cores=engine_cpu_cores(dm, k, os.cpu_count() or 1), own_process=True,
                         interruptible=partial, capture_routes=cfg.captures_routes,
                         max_concurrency=3 if partial else 1, **slot("rollout", k * rpe))
                   for k in range(cfg.rollout.num_engines)]
        if cfg.reward.kind is RewardKind.model:  # actors may not share the driver's cwd: an absolute path
            rm_dir = str(Path(cfg.reward.model_path).resolve())
            rewards = [spawn(RewardModelWorker, "reward", i, rm_dir, device_type=dt, **slot("reward", i))
                       for i in range(cfg.reward.workers)]
        else:
            rewards = [spawn(RuleRewardWorker, "reward", i, cfg.reward.kind, **slot("reward", i))
                       for i in range(cfg.reward.workers)]
        roles = Roles(trainer, reference, engines, rewards, pgs, cfg.trainer.collective_timeout_s + 60)
        log(f"roles: {W} trainer rank(s), {len(reference)} reference rank(s), {len(engines)} engine(s), "
            f"{len(rewards)} reward worker(s) starting")
        for group in (trainer, reference):
            if group:
                addr = group[0].call("address")
                call_all([(h, "init", addr, {}) for h in group], START_TIMEOUT_S)
        call_all([(e, "address", (), {}) for e in engines], START_TIMEOUT_S)  # engines up (vLLM start is slow)
        host, port = trainer[0].call("address")
        backend = backend_for(dt.value, cfg.trainer.backend.value)
        call_all([(h, "join_sync", (host, port, sync_layout.world_size), {}) for h in trainer]
                 + [(e, "join_sync", (host, port, sync_layout.engine_ranks(k)[0], sync_layout.world_size, backend,
                                      cfg.trainer.collective_timeout_s), {}) for k, e in enumerate(engines)],
                 START_TIMEOUT_S)
        log(f"roles: every group joined (trainer, reference, weight sync: {W} trainer ranks and "
            f"{sync_layout.engines.world_size} engine ranks)")
        return roles

    # --- fan-out calls ---
    def all(self, group: Sequence[RoleHandle], method: str, *args, timeout_s: float | None = None,
            per_rank: Sequence[dict] | None = None, **kwargs) -> list:
        """`method` on every rank at once; `per_rank`: keyword arguments of each rank's own."""
        extra = per_rank or [{}] * len(group)
        return call_all([(h, method, args, kwargs | e) for h, e in zip(group, extra)], timeout_s or self.timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]], n: int, seed: int, **kwargs) -> list:
        """Completions of every prompt, prompts split evenly over the engines; prompt_index refers to `prompts`."""
        from dataclasses import replace

        k = len(self.engines)
        chunks = [list(range(i, len(prompts), k)) for i in range(k)]
        # Seeds by the prompt's place in the whole call: the samples do not depend on the engine count.
        calls = [(e, "generate", ([prompts[i] for i in idx],),
                  dict(n=n, seed=[prompt_seed(seed, i) for i in idx], **kwargs))
                 for e, idx in zip(self.engines, chunks) if idx]
        outs = call_all(calls, self.timeout_s)
        merged = [replace(c, prompt_index=idx[c.prompt_index]) for idx, out in zip(chunks, outs) for c in out]
        return sorted(merged, key=lambda c: c.prompt_index)  # stable: samples of a prompt keep their order

    def score(self, responses: Sequence[str], answers: Sequence[str],
              prompts: Sequence[str] | None = None) -> tuple[list[float], list[ScoreReply]]:
        """Scores split evenly over the reward workers (a reward model reads prompt + response)."""
        k = len(self.rewards)
        bounds = [len(responses) * i // k for i in range(k + 1)]
        outs = call_all([(w, "score", (responses[a:b], answers[a:b]), {"prompts": None if prompts is None else prompts[a:b]})
                         for w, a, b in zip(self.rewards, bounds, bounds[1:])], self.timeout_s)
        return [s for o in outs for s in o.scores], outs

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

    def sync_weights(self, sync_layout, version: int, same_device=frozenset()) -> SyncReplies:
        """Trainer ranks send, engine hosts receive and install (pairs in `same_device` through shared
        memory)."""
        calls = [(h, "send_weights", (sync_layout, same_device), {}) for h in self.trainer]
        calls += [(e, "receive_weights", (sync_layout, version, same_device), {}) for e in self.engines]
        replies = call_all(calls, self.timeout_s)
        return SyncReplies(replies[:len(self.trainer)], replies[len(self.trainer):])

    def shutdown(self) -> None:
        import ray

        for e in self.engines:
            try:
                e.call("close", timeout_s=60)
            except Exception:
                pass
        for h in self.trainer + self.reference + self.engines + self.rewards:
            try:
                h.kill()
            except Exception:
                pass
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)


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
    from rlhf.schema import DeviceType

    devices = p.nodes * p.devices_per_node
    resources = {p.device_resource: devices} if p.device_type is DeviceType.cpu else {}
    # Logical CPUs: each device bundle asks for cpus_per_device; a small machine still hosts the placement
    # (processes share its cores, as co-located roles do).
    num_cpus = max(os.cpu_count() or 1, int(devices * p.cpus_per_device + 0.999))
    # address="local": a new instance even where /tmp/ray/ray_current_cluster names another (left by `ray start`
    # or ray.cluster_utils, alive or long dead); with no address Ray would join that one and refuse num_cpus.
    ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=False)
    log(f"ray: started an embedded local instance ({num_cpus} CPUs, {resources or 'no custom resources'}); "
        f"actor logs are under /tmp/ray/session_latest/logs")
    return True


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
