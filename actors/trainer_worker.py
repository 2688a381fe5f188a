"""One rank of the policy trainer or of the reference model, as a plain class (a Ray actor where the
driver spawns it).

Every rank of a role joins that role's own torch.distributed group (the training layout); trainer
ranks also join the weight-sync group with the rollout engines (`weight_sync.group`). The driver sends
every rank the whole `TokenBatch` (one Ray object, shared); each rank takes its DP index's share,
balanced by tokens (`TokenBatch.micro_batches`), so no rank waits on another's scatter.

The reference is a `PolicyWorker`: the same sharded model, frozen, offloaded between uses.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from actors.remote import node_address
from actors.replies import LogprobsReply, SendReply, UpdateReply, UpdateStats
from rlhf.algorithms.objective import LossRecord, loss_normaliser, policy_loss
from rlhf.batch import TokenBatch
from rlhf.cpu_matmul import compute_dtype_problem
from rlhf.errors import ConfigError
from rlhf.host_memory import small_onednn_cache, trim_heap
from rlhf.model.head import release_scratch
from rlhf.moe.routing import RouteFetch, RouteShare
from rlhf.schema import AlgorithmConfig, DeviceType, ModelConfig, TrainerConfig
from rlhf.parallel.comm import backend_for, init_process_group
from rlhf.parallel.trainer import ParallelTrainer
from rlhf.sharding.layout import trainer_layout


def _node_id() -> str:
    """This process's Ray node (nodes of a test cluster share a host), or its host outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        import socket

        return socket.gethostname()


class PolicyWorker:
    """A rank of a sharded policy that computes per-token logprobs (the reference role)."""

    def __init__(self, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, device_type: DeviceType,
                 rank: int, model_dir: str, threads: int = 1):
        problem = compute_dtype_problem(model_cfg, trainer_cfg, device_type)  # this rank's machine
        if problem:
            raise ConfigError(problem)
        small_onednn_cache()  # before this process's first matmul
        torch.set_num_threads(threads)
        self.model_cfg, self.tcfg, self.device_type, self.rank = model_cfg, trainer_cfg, device_type, rank
        self.model_dir = model_dir
        self.layout = trainer_layout(trainer_cfg)
        self.trainer: ParallelTrainer | None = None

    def address(self, local: bool = False) -> tuple[str, int]:
        return node_address(local)

    def pid(self) -> int:
        return os.getpid()

    def init(self, master_addr: str, master_port: int) -> dict:
        """Join this role's process group and load this rank's shards."""
        t0 = time.time()
        init_process_group(self.rank, self.layout.world_size, master_addr, master_port, self.device_type.value,
                           self.tcfg.backend.value, self.tcfg.collective_timeout_s)
        per_node = None
        if self.tcfg.hierarchical_ep:  # the Ray node of every rank, in rank order
            import torch.distributed as dist

            from rlhf.parallel.dispatch import ranks_per_node

            nodes: list = [None] * self.layout.world_size
            dist.all_gather_object(nodes, _node_id())
            per_node = ranks_per_node(nodes)
        self.trainer = ParallelTrainer(self.model_cfg, self.tcfg, self.layout, self.rank, self.model_dir,
                                       ranks_per_node=per_node, hierarchical_ep=self.tcfg.hierarchical_ep,
                                       device=self._device())
        return {"rank": self.rank, "seconds": time.time() - t0, "ranks_per_node": per_node}

    @property
    def _returns_rows(self) -> bool:
        """Whether this rank's logprobs are the ones the driver keeps (last stage, TP index 0)."""
        c = self.layout.coords(self.rank)
        return self.trainer.is_last_stage and c.tp == 0

    def logprobs(self, batch: TokenBatch, routes: RouteShare | RouteFetch | None = None) -> LogprobsReply | None:
        """Per-token logprobs and entropies [rows, T-1] of this DP rank's samples, from one rank per DP
        index; None from the others. `routes`: this rank's share of the engines' routes (sent apart)."""
        t0 = time.time()
        batch = self._with_routes(batch, routes)
        self.trainer.onload(self._device())
        c = self.layout.coords(self.rank)
        mbs = batch.micro_batches(range(len(batch)), self.layout.dp, c.dp, self.tcfg.micro_batch_tokens)
        out = self.trainer.logprobs(mbs, batch.temperature)
        if not self._returns_rows:
            return None
        return _rows_reply(batch, [mb.extras["rows"] for mb in mbs], out, t0, self.trainer.route_differs)

    @staticmethod
    def _with_routes(batch: TokenBatch, routes: RouteShare | RouteFetch | None) -> TokenBatch:
        if isinstance(routes, RouteFetch):  # read from the engines' blocks in the object store
            import ray

            routes = routes.resolve(ray.get)
        return batch if routes is None else batch.with_(route_share=routes)

    def offload(self) -> int:
        return self.trainer.offload()

    def onload(self) -> int:
        return self.trainer.onload(self._device())

    def _device(self) -> str:
        return "cpu" if self.device_type is DeviceType.cpu else self.device_type.value


class TrainerWorker(PolicyWorker):
    """A rank of the policy trainer: logprobs, the policy update, weight sync, checkpoints."""

    def __init__(self, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, algorithm_cfg: AlgorithmConfig,
                 device_type: DeviceType, rank: int, model_dir: str, threads: int = 1, stale_pids: Sequence[int] = ()):
        """`stale_pids`: trainer ranks this one's start replaces (killed): the weight-sync shared-memory
        segments they created and could not unlink are removed."""
        super().__init__(model_cfg, trainer_cfg, device_type, rank, model_dir, threads)
        from weight_sync.shm import remove_segments_of

        for pid in stale_pids:
            remove_segments_of(pid)
        self.algo = algorithm_cfg
        self.sync_group = None
        self.updated = False  # the last update ran to its end (what a sync queued behind it may send)

    def update(self, batch: TokenBatch, mini_batches: Sequence[Sequence[int]],
               routes: RouteShare | RouteFetch | None = None, offload_next: bool = False) -> UpdateReply:
        """One policy update: for every epoch, one optimizer step per mini-batch (sample indices, the
        same on every rank). The loss of a mini-batch is normalised by its global token (or sequence)
        count, so gradients summed over micro-batches and DP ranks are the mini-batch's gradient.
        `offload_next` (co-location: the trainer is offloaded after the sync queued behind this update): on cpu
        the heap pages the update freed go back now, before the sync's shared-memory staging is written, not at
        the offload after it (the step's memory peak was the two at once)."""
        t0, self.updated = time.time(), False
        batch = self._with_routes(batch, routes)
        self.trainer.onload(self._device())
        c = self.layout.coords(self.rank)
        record, losses, norms = LossRecord(), [], []
        # on-policy (no old logprobs in the batch): the first forward's logprobs are the sampling weights'
        # own, returned for the parity check and the entropy metric instead of a separate pass
        seen: list[tuple] = [] if batch.old_logp_BT is None else None

        def loss(logp, ent, mb):
            if seen is not None and len(losses) == 0:
                seen.append((mb.extras["rows"], logp.detach(), ent.detach()))
            return policy_loss(self.algo, logp, ent, mb.extras, normaliser, record)

        for _ in range(self.tcfg.epochs):
            for rows in mini_batches:
                rows = list(rows)
                normaliser = loss_normaliser(self.algo, batch.mask_BT[rows])
                mbs = batch.micro_batches(rows, self.layout.dp, c.dp, self.tcfg.micro_batch_tokens)
                out = self.trainer.train_step(mbs, loss, batch.temperature, first=seen is not None and not losses)
                losses.append(out["loss"])
                norms.append(out["grad_norm"])
        self.trainer.release_grads()  # before the sync queued behind this update: its memory goes back now
        if offload_next and self.device_type is DeviceType.cpu:
            release_scratch()  # the head's reused buffers go back with the update's other memory
            trim_heap()
        n = max(record.tokens, 1.0)
        stats = UpdateStats(loss=sum(losses) / len(losses), grad_norm=max(norms), optimizer_steps=len(losses),
                            lr=out["lr"], clip_fraction=record.clip_fraction / n, ratio_mean=record.ratio / n,
                            kl=record.kl / n, entropy=record.entropy / n, tokens=record.tokens,
                            router_bias_abs_max=self.trainer.router_bias_abs_max())
        router = self.trainer.router_stats()  # a collective over the stage: every rank calls it
        # every rank reports its own token-weighted sums; the driver combines DP ranks
        logprobs = None
        if seen and self._returns_rows:
            rows, out = [r for r, _, _ in seen], [(lp, e) for _, lp, e in seen]
            logprobs = _rows_reply(batch, rows, out, t0, self.trainer.route_differs)
        reports = self.rank == self.layout.stage_group(self.rank)[0]  # one rank per stage: its MoE layers
        self.updated = True
        return UpdateReply(stats, router.tolist() if reports else None, t0, time.time() - t0, logprobs)

    def migrate_experts(self, expert_maps: Sequence[Sequence[int]]) -> dict:
        """Expert-load balancing: place each MoE layer's experts by `expert_maps` (`ParallelTrainer.migrate_experts`;
        every rank, the same maps). Returns this rank's experts moved, bytes sent and seconds."""
        t0 = time.time()
        self.trainer.onload(self._device())
        out = self.trainer.migrate_experts(expert_maps)
        return out | {"seconds": time.time() - t0}

    # --- weight sync ---
    def join_sync(self, host: str, port: int, world_size: int) -> bool:
        from weight_sync.group import transfer_group

        backend = backend_for(self.device_type.value, self.tcfg.backend.value)
        if self.sync_group is not None:  # a re-formed group (an engine was replaced) replaces the old one
            self.sync_group.close()
        self.sync_group = transfer_group(backend, host, port, self.rank, world_size, self.tcfg.collective_timeout_s)
        return True

    def link_probe(self, peer: int, nbytes: int, rounds: int) -> int:
        """Send `rounds` messages of `nbytes` to transfer rank `peer` (it times them: the sync's link speed)."""
        from weight_sync.group import isend

        buf = torch.ones(nbytes, dtype=torch.uint8)
        for _ in range(rounds):
            isend(buf, peer, self.sync_group).wait()
        return nbytes * rounds

    def send_weights(self, sync, same_device=frozenset(), posted: bool = False) -> SendReply:
        """Send this rank's part of the sync plan (`rlhf.placement.transfer.SyncLayout`); pairs in
        `same_device` go through shared memory. `posted`: queued behind this step's update, with the engines
        already waiting (`weight_sync.p2p.await_senders`): announced to them first; refused, nothing sent (and
        the engines told so), unless that update ran to its end."""
        from weight_sync.p2p import announce, run_plan

        t0, go = time.time(), []
        if posted:
            go = announce(sync.plan(), self.rank, self.sync_group, starts=self.updated)
            if not self.updated:  # the engines waiting for this rank stop at once
                for work in go:
                    work.wait()
                raise RuntimeError("weight sync queued behind an update that did not finish: nothing sent")
        self.trainer.onload(self._device())
        _, src = self.trainer.export_shards()
        fmt = sync.wire_format()
        if fmt is not None:  # quantized rollout: this rank quantizes the blocks it holds and sends bytes
            from weight_sync.quant import owner_wire_buffers, quantized_buffers, sent_buffers

            plan = sync.plan()
            if getattr(self, "_wire_plan", None) is not plan:  # once per plan: the buffers holding quantized weights
                typed = sync.typed_specs()[0]
                mine = next(r for r in typed.ranks if r.rank == self.rank)
                self._wire_plan, self._wire_quantized = plan, quantized_buffers(mine, fmt, typed.shapes())
            sent = sent_buffers(plan, self.rank)  # only what it sends (replicas share the sending)
            src = owner_wire_buffers({n: t for n, t in src.items() if n in sent}, self._wire_quantized, fmt)
        # what travels is the engines' dtype (the shards cast as they are packed: fp32 -> bf16 engines; bytes when
        # quantized)
        stats = run_plan(sync.plan(), self.rank, src, None, getattr(torch, sync.dst_spec().dtype),
                         group=self.sync_group, same_device=same_device)
        for work in go:
            work.wait()
        return SendReply(stats.bytes_sent, stats.bytes_shm_sent, stats.bytes_local, t0, time.time() - t0)

    def hf_shards(self) -> tuple[list, dict]:
        """This rank's HF pieces and the tensors holding them: what a gather-then-broadcast sync collects
        (the in-loop resharding benchmark's baseline)."""
        self.trainer.onload(self._device())
        sharding, tensors = self.trainer.export_shards()
        return list(sharding.pieces), {n: t.contiguous() for n, t in tensors.items()}

    # --- checkpoints ---
    def save(self, ckpt_dir: str) -> dict:
        from rlhf.checkpoint import save_rank

        t0 = time.time()
        was_offloaded = self.trainer._offloaded is not None
        self.trainer.onload(self._device())
        save_rank(Path(ckpt_dir), self.rank, self.trainer)
        if was_offloaded:  # co-location: leave the device as the schedule had it
            self.trainer.offload()
        return {"seconds": time.time() - t0}

    def load(self, ckpt_dir: str) -> dict:
        from rlhf.checkpoint import load_rank

        t0 = time.time()
        self.trainer.onload(self._device())
        load_rank(Path(ckpt_dir), self.rank, self.trainer)
        return {"seconds": time.time() - t0}


def _rows_reply(batch: TokenBatch, rows: list[torch.Tensor], out: list[tuple[torch.Tensor, torch.Tensor]],
                t0: float, route_differs: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> LogprobsReply:
    """Per-micro-batch (logp, entropy) [rows, T'-1], padded to the batch's length, with their batch rows (and
    the route mismatch counts [rows, T'] of the same micro-batches, when measured)."""
    T = batch.mask_BT.shape[1]
    # computed on the rank's device; the reply travels in host memory
    logp = torch.cat([torch.nn.functional.pad(lp, (0, T - lp.shape[1])) for lp, _ in out]).cpu()
    ent = torch.cat([torch.nn.functional.pad(e, (0, T - e.shape[1])) for _, e in out]).cpu()
    differs = None
    if route_differs:
        assert all(torch.equal(r, d_rows) for r, (d_rows, _) in zip(rows, route_differs))
        differs = torch.cat([torch.nn.functional.pad(d, (0, T + 1 - d.shape[1])) for _, d in route_differs])
    return LogprobsReply(torch.cat(rows), logp, ent, t0, time.time() - t0, differs)
