"""The parallel MoE policy trainer of one rank: logprobs, loss backward, gradient sync, clip, AdamW,
offload/onload, recomputation, shard export and checkpoint state. A plain class; a Ray actor hosts it.

Every rank of the layout runs the same calls with the micro-batches of its DP index (TP ranks and
pipeline stages of one DP index get the same micro-batches; every rank of a stage must run the same
number of them, since EP all-to-alls span DP ranks: `rlhf.micro_batches` arranges that).

Legend: B batch, T tokens, V vocab.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlhf.batch import MicroBatch
from rlhf.host_memory import trim_heap
from rlhf.moe.routing import ROUTE_DTYPE, Routing
from rlhf.schema import ModelConfig, RoutingReplay, TrainerConfig
from rlhf.model.head import release_scratch
from rlhf.model.hf_io import load_local_shards
from rlhf.model.layers import autocast_off, casts_kept
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM, router_bias_update
from rlhf.sharding.trainer import Split, TrainerSharding, is_frozen, layer_expert_maps, rank_sharding, row_sharded, split_of
from rlhf.parallel.comm import LayoutGroups, all_reduce, all_reduce_bucketed, bounded, build_groups
from rlhf.parallel.dispatch import Dispatcher, FlatDispatcher
from rlhf.parallel.grads import Gradients
from rlhf.parallel.migrate import move_experts
from rlhf.parallel.optim import ShardedAdamW
from rlhf.parallel.parallelize import grad_group_of, parallelize, replicas_of
from rlhf.parallel.pipeline import PipelineRunner
from rlhf.parallel.zero3 import RowShard, shard_parameters
from rlhf.sharding.layout import Layout, check_expert_map, default_expert_map


# (logp_BT, entropy_BT, micro-batch) -> scalar loss, already divided by the global normaliser
LossFn = Callable[[torch.Tensor, torch.Tensor, MicroBatch], torch.Tensor]


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """logp[:, t] = log p(input_ids[:, t+1] | prefix) and the entropy of that distribution: [B, T-1] each.
    `temperature`: the distribution the rollout sampled from, softmax(logits / temperature)."""
    logits = logits_BTV[:, :-1].float()
    logp_all = F.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    logp = logp_all.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


RECOMPUTE_KINDS = {"attention": ("self_attn",), "experts": ("mlp",), "norms": ("input_layernorm",
                                                                             "post_attention_layernorm")}


class ParallelTrainer:
    def __init__(self, model_cfg: ModelConfig, trainer_cfg: TrainerConfig, layout: Layout, rank: int,
                 model_dir: str | Path, expert_map: Sequence[int] | None = None,
                 stage_split: Sequence[int] | None = None, ranks_per_node: int | None = None,
                 hierarchical_ep: bool = False, device: str | torch.device = "cpu"):
        """`device`: where the rank computes ("cpu", "cuda", "npu": under Ray the actor's own accelerator is
        device 0 of those it sees); shards are loaded on the host, then moved there once."""
        self.cfg, self.tcfg, self.layout, self.rank = model_cfg, trainer_cfg, layout, rank
        self.device = torch.device(device)
        backend = getattr(torch, self.device.type, None)  # torch.cuda; torch.npu once torch_npu is imported
        if self.device.type != "cpu" and not (backend is not None and backend.is_available()):
            raise RuntimeError(f"trainer rank {rank}: no {self.device.type} device in this process; set "
                               f"placement.device_type to the devices the ranks run on (cpu, cuda, npu)")
        self.groups: LayoutGroups = build_groups(layout, rank, trainer_cfg.collective_timeout_s,
                                                 model_cfg.num_key_value_heads)
        self.expert_map = tuple(expert_map) if expert_map is not None else default_expert_map(
            model_cfg.num_experts, layout.expert_shards)
        self.moe_layers = model_cfg.num_hidden_layers - model_cfg.first_k_dense_layers
        # expert -> EP shard per MoE layer: the base map until expert-load balancing migrates a layer
        self.expert_maps: tuple[tuple[int, ...], ...] = (self.expert_map,) * self.moe_layers
        self.stage_split = stage_split
        self.stages = layout.stage_layers(model_cfg.num_hidden_layers, stage_split)
        self.stage = layout.coords(rank).pp
        self.sharding: TrainerSharding = rank_sharding(model_cfg, layout, rank, self.expert_map, stage_split,
                                                       trainer_cfg.zero_stage)
        with torch.device("meta"):
            model = Qwen3MoeForCausalLM(model_cfg)
        local = load_local_shards(model_dir, self.sharding)
        if hierarchical_ep:
            from rlhf.parallel.dispatch import HierarchicalDispatcher
            self.dispatcher: Dispatcher = HierarchicalDispatcher(self.groups, ranks_per_node)
        else:
            self.dispatcher = FlatDispatcher(self.groups, ranks_per_node)
        self.model = parallelize(model, self.sharding, self.groups, local,
                                 layer_expert_maps(model_cfg, layout, self.expert_map), self.stages, self.dispatcher)
        self.row_shards: dict[str, RowShard] = {}  # zero_stage=3: the parameters gathered on use
        if trainer_cfg.zero_stage == 3:
            self._shard_parameters(stage_split)
        self._apply_recompute(trainer_cfg.recompute)
        if self.device.type != "cpu":  # parameters keep their objects (the row shards' references stay valid)
            self.model.to(self.device)
        named = dict(self.model.named_parameters())
        self.params = {n: self.zero3_params[n] if n in self.row_shards else named[n] for n in self.sharding.local_shapes}
        # what the optimizer steps: all but the frozen (router correction bias, MTP modules), which stay as loaded
        self.trained = {n: p for n, p in self.params.items() if not is_frozen(n, model_cfg)}
        self.optimizer = ShardedAdamW(self._optimizer_buckets(), lr=trainer_cfg.lr, betas=tuple(trainer_cfg.betas),
                                      eps=trainer_cfg.adam_eps, weight_decay=trainer_cfg.weight_decay)
        self.pipeline = PipelineRunner(self.model, self.groups, self.stages, self._compute) if layout.pp > 1 else None
        self._offloaded: list | None = None
        self.grads = Gradients(self.trained, self.device)
        self._old_routes: dict[int, torch.Tensor] = {}  # R2: batch row -> this stage's routes [T, L, k]
        # per micro-batch of the last measured forward: (batch rows, MoE layers that chose another expert set
        # than the engine, per token [B, T], summed over the pipeline stages)
        self.route_differs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.step_loads: torch.Tensor | None = None  # tokens per expert of the last optimizer step, summed over the stage

    def _shard_parameters(self, stage_split) -> None:
        """zero_stage=3: the loaded row shards become parameters gathered by each unit's forward."""
        full = rank_sharding(self.cfg, self.layout, self.rank, self.expert_map, stage_split).local_shapes
        split = row_sharded(self.layout, self.rank, self.sharding.local_shapes)
        self.row_shards.update({name: RowShard(tuple(full[name]), n, i) for name, (_, n, i) in split.items()})
        axis_of = {name: axis for name, (axis, _, _) in split.items()}
        self.zero3_params = shard_parameters(self.model, self.row_shards,
                                             {"dp": self.groups.dp, "expert_replica": self.groups.expert_replica},
                                             axis_of)

    # --- forward ---
    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.layout.pp - 1

    def _compute_dtype(self) -> torch.dtype | None:
        """trainer.compute_dtype where it differs from the model's (the matmuls under autocast), else None."""
        dt = self.tcfg.compute_dtype or self.cfg.dtype
        return None if dt is self.cfg.dtype else getattr(torch, dt.value)

    def _compute(self):
        """Autocast to trainer.compute_dtype if it differs from the model's (backward follows the forward's dtypes)."""
        dtype = self._compute_dtype()
        return nullcontext() if dtype is None else torch.autocast(self.device.type, dtype)

    def _casts_kept(self):
        """Over a step's micro-batches: each weight cast to the compute dtype once (`rlhf.model.layers.casts_kept`)."""
        return casts_kept(self.device.type, self._compute_dtype())

    def _hidden(self, mb: MicroBatch) -> torch.Tensor:
        with self._compute():
            return self.model.hidden_states(mb.input_ids_BT, mb.attention_mask_BT, routing=mb.routing)

    # --- routing replay (rlhf.moe.routing) ---
    def _routed(self, micro_batches: Sequence[MicroBatch], first: bool) -> list[MicroBatch]:
        """The micro-batches with the routing their forwards use: the routes to force (the engine's, R3, or
        those this rank recorded in the step's old-logprob forward, R2) and, in the step's first forward
        (`first`), the engine's routes to compare with and the R2 record."""
        mode = self.tcfg.routing_replay
        if first:
            self._old_routes.clear()
        out = []
        for mb in map(self._on_device, micro_batches):
            forced = None
            if mode is RoutingReplay.rollout:
                if mb.routes_BTLk is None:
                    raise ValueError("trainer.routing_replay=rollout but the batch carries no engine routes "
                                     "(rollout.capture_routes)")
                forced = mb.routes_BTLk
            elif mode is RoutingReplay.old and self._old_routes:
                forced = self._recorded_routes(mb)
            engine = mb.routes_BTLk if first else None
            record = first and mode is RoutingReplay.old
            out.append(mb if forced is None and engine is None and not record
                       else replace(mb, routing=Routing(forced, engine, record)))
        return out

    def _on_device(self, mb: MicroBatch) -> MicroBatch:
        """The micro-batch's tensors (ids, mask, routes, the loss's extras) on this rank's device."""
        if self.device.type == "cpu":
            return mb
        dev = self.device
        moved = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in mb.extras.items()}
        return replace(mb, input_ids_BT=mb.input_ids_BT.to(dev), attention_mask_BT=mb.attention_mask_BT.to(dev),
                       extras=moved, routes_BTLk=None if mb.routes_BTLk is None else mb.routes_BTLk.to(dev))

    def _recorded_routes(self, mb: MicroBatch) -> torch.Tensor:
        B, T = mb.input_ids_BT.shape
        k = self.cfg.num_experts_per_tok
        out = torch.full((B, T, self.moe_layers, k), -1, dtype=ROUTE_DTYPE, device=self.device)
        for i, row in enumerate(mb.extras["rows"].tolist()):
            r = self._old_routes[row]
            out[i, :r.shape[0]] = r
        return out

    def _after_first_forward(self, micro_batches: Sequence[MicroBatch]) -> None:
        """Keep the R2 record by batch row; sum each token's differing layers over the pipeline stages (a
        collective over the stage axis: every rank calls it)."""
        self.route_differs = []
        routed = [mb for mb in micro_batches if mb.routing is not None]
        if not routed:
            return
        k = self.cfg.num_experts_per_tok
        for mb in routed:
            if mb.routing.record:
                B, T = mb.input_ids_BT.shape
                chosen = mb.routing.chosen_BTLk(B, T, self.moe_layers, k)
                for i, (row, n) in enumerate(zip(mb.extras["rows"].tolist(), mb.attention_mask_BT.sum(1).tolist())):
                    self._old_routes[row] = chosen[i, :n].clone()
        if routed[0].routing.engine_BTLk is not None:
            counts = [mb.routing.differ_count_BT(*mb.input_ids_BT.shape) for mb in routed]
            flat = torch.cat([c.reshape(-1) for c in counts]).to(torch.int32)
            if self.layout.pp > 1:
                flat = all_reduce(flat, self.groups.pp)
            parts = flat.split([c.numel() for c in counts])
            self.route_differs = [(mb.extras["rows"].cpu(), p.view_as(c).to(ROUTE_DTYPE).cpu())
                                  for mb, p, c in zip(routed, parts, counts)]

    def _score(self, temperature: float):
        """(final hidden [B, T, H], ids[, mask [B, T-1]]) -> (logp, entropy) [B, T-1] of each next token: the fused LM
        head. With `mask` (the positions a loss reads: the response tokens) the head runs on those positions alone
        and the others are 0: the prompt's positions (and padding) cost nothing, and a loss that weighs every
        position by the mask gets the same values and gradients (up to the rounding of products over fewer rows)."""
        def score(hidden_BTH, ids_BT, mask_BT=None):
            h_BTH, t_BT = hidden_BTH[:, :-1], ids_BT[:, 1:]
            with self._compute():
                if mask_BT is None:
                    return self.model.lm_head(h_BTH, t_BT, temperature)
                keep_BT = mask_BT > 0
                logp_1N, ent_1N = self.model.lm_head(h_BTH[keep_BT][None], t_BT[keep_BT][None], temperature)
            zeros = torch.zeros(keep_BT.shape, dtype=logp_1N.dtype, device=logp_1N.device)
            return zeros.masked_scatter(keep_BT, logp_1N[0]), zeros.masked_scatter(keep_BT, ent_1N[0])
        return score

    @torch.no_grad()
    def logprobs(self, micro_batches: Sequence[MicroBatch], temperature: float = 1.0
                 ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(logp_BT, entropy_BT) per micro-batch on the last pipeline stage; None on other stages."""
        self.model.eval()
        score = self._score(temperature)
        micro_batches = self._routed(micro_batches, first=True)
        with self._bounded("logprob forward"), self._casts_kept():
            if self.pipeline is not None:
                out = self.pipeline.forward_only(micro_batches, score)
            else:
                out = [score(self._hidden(mb), mb.input_ids_BT) for mb in micro_batches]
            self._after_first_forward(micro_batches)
        return out

    # --- training ---
    def train_step(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, temperature: float = 1.0,
                   first: bool = False) -> dict:
        """Accumulate gradients over the micro-batches, sync, clip, and take one AdamW step. Logprobs are those
        of softmax(logits / temperature), the distribution the rollout sampled from. `first`: the step's first
        forward (on-policy updates have no separate old-logprob forward), where routes are measured."""
        self._check_onloaded()
        self.model.train()
        score = self._score(temperature)
        micro_batches = self._routed(micro_batches, first)
        for block in self._moe_blocks():
            block.step_tokens_per_expert = None
        self.grads.zero(self.optimizer.buckets)
        with self._bounded("forward and backward (expert all-to-all, tensor-parallel and pipeline exchanges)"), \
                self._casts_kept():
            if self.pipeline is not None:
                losses = self.pipeline.train(micro_batches, loss_fn, score)
            else:
                losses = []
                for mb in micro_batches:
                    logp, ent = score(self._hidden(mb), mb.input_ids_BT, mb.extras.get("mask"))
                    loss = loss_fn(logp, ent, mb)
                    with autocast_off(self.device.type):
                        loss.backward()
                    losses.append(loss.detach())
            if first:
                self._after_first_forward(micro_batches)
        with self._bounded("gradient all-reduce and clipping"):
            self.sync_grads()
            grad_norm = self.clip_grads(self.tcfg.grad_clip)
        with self._bounded("optimizer step (sharded AdamW state)"):
            self.optimizer.set_lr(self.current_lr())
            self.optimizer.step()
        with self._bounded("expert loads and loss all-reduce"):
            self._balance_router_bias()
            loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
            # the global loss: sum over DP ranks of last-stage partial sums (other stages contribute 0)
            loss_sum = all_reduce(loss_sum.clone(), self.groups.dp)
        return {"loss": float(loss_sum), "grad_norm": float(grad_norm), "lr": self.optimizer.opt.param_groups[0]["lr"]}

    def current_lr(self) -> float:
        """The learning rate of the next optimizer step: linear warmup over `lr_warmup_steps`, then flat,
        or (`lr_decay_steps` > 0) a cosine from lr down to lr * lr_min_ratio over that many steps, then
        held. Counted by the optimizer's own step count, which checkpoints carry."""
        t, step = self.tcfg, self.optimizer.steps_taken
        if step < t.lr_warmup_steps:
            return t.lr * (step + 1) / t.lr_warmup_steps
        if t.lr_decay_steps <= 0:
            return t.lr
        progress = min(1.0, (step - t.lr_warmup_steps) / t.lr_decay_steps)
        return t.lr * (t.lr_min_ratio + (1 - t.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def _optimizer_buckets(self) -> dict:
        """Parameters grouped by the ranks holding identical copies of them (their gradient group): each group
        shares one AdamW state, split over its ranks (ZeRO-1). Row shards (zero_stage=3): one bucket, this rank's."""
        buckets: dict[str, tuple] = {}
        for name, p in self.trained.items():
            if name in self.row_shards:  # zero_stage=3: the row shard is this rank's alone to update
                buckets.setdefault("zero3", (None, 1, 0, []))[3].append(p)
                continue
            group, kind = grad_group_of(name, self.groups)
            size = self.groups.size(kind)
            buckets.setdefault(kind, (group if size > 1 else None, size, self.groups.index(kind), []))[3].append(p)
        return buckets

    def sync_grads(self) -> None:
        """Sum each gradient over the ranks that hold the same shard but saw other tokens; flat all-reduces
        of 32 MB buckets per group kind. Row shards (zero_stage=3) arrive summed from their gather's backward.
        tp > KV heads: the TP ranks sharing a KV head each saw their own query heads, so k/v gradients
        are first summed over them."""
        if self.groups.kv_head is not None:
            all_reduce_bucketed([p.grad for n, p in self.trained.items() if split_of(n) is Split.tp_kv_rows],
                                self.groups.kv_head)
        buckets: dict[str, tuple[object, list[torch.Tensor]]] = {}
        for name, p in self.trained.items():
            if name in self.row_shards:
                continue
            group, kind = grad_group_of(name, self.groups)
            if group is not None:
                buckets.setdefault(kind, (group, []))[1].append(p.grad)
        for group, grads in buckets.values():
            all_reduce_bucketed(grads, group)

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over all shards (each replica counted once); clip like clip_grad_norm_."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.trained.items():
            copies = replicas_of(name, self.groups) // (self.row_shards[name].n if name in self.row_shards else 1)
            sq += squares_fp64(p.grad) / copies
        torch.distributed.all_reduce(sq)
        norm = sq.sqrt().float()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in self.trained.values():
                p.grad.mul_(coef)
        return norm

    # --- recomputation ---
    def _apply_recompute(self, kinds: Sequence[str]) -> None:
        for kind in kinds:
            for i in self.stages[self.stage]:
                layer = self.model.model.layers[i]
                for attr in RECOMPUTE_KINDS[kind]:
                    mod = getattr(layer, attr)
                    mod.forward = _checkpointed(mod.forward)

    # --- co-location ---
    def offload(self) -> int:
        """Move parameters and optimizer state (its parameter slices and moments) to host memory, leaving the
        modules and the optimizer without storage; tensor objects stay the same, so references held elsewhere
        remain valid. Gradients are not kept (`release_grads`). Returns the bytes moved."""
        if self._offloaded is not None:
            return 0
        self.release_grads()
        if self.device.type == "cpu":
            release_scratch()  # the head's reused buffers (`rlhf.model.head.SCRATCH`)
            trim_heap()  # the update's freed activations, where glibc holds 64 MiB or more of them
        stash: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in list(self.params.values()) + self.optimizer.owned_tensors():
            host = t.data.to("cpu", copy=True) if t.device.type != "cpu" else t.data
            stash.append((t, host))
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._offloaded = stash
        return sum(h.numel() * h.element_size() for _, h in stash)

    def release_grads(self) -> None:
        """Between steps nothing reads the gradients, and a step starts from zeros (`rlhf.parallel.grads`)."""
        self.grads.release()

    def onload(self, device: str | torch.device | None = None) -> int:
        """Restore what `offload` moved, bit-exactly, onto `device` (this rank's own by default); returns its bytes."""
        if self._offloaded is None:
            return 0
        device = self.device if device is None else device
        nbytes = 0
        for t, host in self._offloaded:
            t.data = host.to(device)
            nbytes += host.numel() * host.element_size()
        self._offloaded = None
        return nbytes

    def _check_onloaded(self, before: str = "training") -> None:
        if self._offloaded is not None:
            raise RuntimeError(f"trainer is offloaded: call onload() before {before}")

    # --- export ---
    def export_shards(self) -> tuple[TrainerSharding, dict[str, torch.Tensor]]:
        """This rank's local tensors (by our parameter name) and the sharding that says which box of
        which HF tensor each holds: the resharding layer's input."""
        self._check_onloaded()
        return self.sharding, {n: p.detach() for n, p in self.params.items()}

    # --- expert-load balancing (rlhf.moe.balance) ---
    def migrate_experts(self, expert_maps: Sequence[Sequence[int]], move_state: bool = True) -> dict:
        """Place each MoE layer's experts by `expert_maps` (one expert -> EP shard map per MoE layer, the
        order of `router_stats`): every expert that changes shard goes, with both AdamW moments, from each
        rank holding it to the rank of the same expert-replica position on its new shard, in one all-to-all
        over the EP group (ZeRO-1 moment slices and ZeRO-3 row shards are gathered over the expert replicas
        first and re-split after); token dispatch, the shard export and checkpoints follow the new maps. A
        permutation: logprobs, gradients and later AdamW steps are those of the unmigrated trainer.
        `move_state=False` only relabels (a checkpoint saved under these maps is loaded next). Every rank
        calls it with the same maps. Returns {"experts_moved", "bytes_sent"} of this rank's stage."""
        self._check_onloaded("migrating experts")
        new = tuple(tuple(int(s) for s in m) for m in expert_maps)
        if len(new) != self.moe_layers:
            raise ValueError(f"{len(new)} expert maps for {self.moe_layers} MoE layers")
        for m in new:
            check_expert_map(m, self.cfg.num_experts, self.layout.expert_shards)
        old, first = self.expert_maps, self.cfg.first_k_dense_layers
        mine = [j for j in (i - first for i in self.stages[self.stage] if i >= first) if new[j] != old[j]]
        out = {"experts_moved": sum(a != b for j in mine for a, b in zip(old[j], new[j])), "bytes_sent": 0}
        if not mine:
            self.expert_maps = new
            return out
        if move_state:
            with self._bounded("expert migration (all-to-all of expert weights and AdamW moments over EP)"):
                out["bytes_sent"] = move_experts(self, old, new, mine)
        self.expert_maps = new
        self.sharding = rank_sharding(self.cfg, self.layout, self.rank, self.expert_map, self.stage_split,
                                      self.tcfg.zero_stage, expert_maps=new)
        for block in self._moe_blocks():
            block.set_map(new[block.moe_index])
        return out

    # --- checkpoints ---
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's training state: its parameters (by our parameter name) and its optimizer state
        (`optim/<bucket kind>/<master|exp_avg|exp_avg_sq|step>`; bucket kinds are gradient groups: dp,
        stage, expert_replica). Tensors share storage with the trainer; copy them before training on."""
        self._check_onloaded("taking its state")
        sd = {name: p.detach() for name, p in self.params.items()}
        sd |= {f"optim/{k}": t.detach() for k, t in self.optimizer.state_tensors().items()}
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Restore a `state_dict` of the same rank of the same layout, bit-exactly. `source` names where
        `sd` came from in errors (e.g. the checkpoint file and the layout it was saved with)."""
        self._check_onloaded("loading a state")
        want = {k: (tuple(t.shape), t.dtype) for k, t in self.state_dict().items()}
        where = f"{source} does not fit this trainer (layout {self.layout}, rank {self.rank})"
        missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
        if missing or unexpected:
            raise ValueError(f"{where}: missing keys {missing[:3]} ({len(missing)} in all), unexpected keys "
                             f"{unexpected[:3]} ({len(unexpected)} in all); a state loads only into the layout, "
                             "expert map and stage split it was saved with")
        for k, (shape, dtype) in want.items():
            if (tuple(sd[k].shape), sd[k].dtype) != (shape, dtype):
                raise ValueError(f"{where}: {k} is {tuple(sd[k].shape)} {sd[k].dtype} there, {shape} {dtype} "
                                 "here; a state loads only into the layout, expert map and stage split it was "
                                 "saved with")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(sd[name])
        self.optimizer.load_state_tensors({k[len("optim/"):]: t for k, t in sd.items() if k.startswith("optim/")})

    def _bounded(self, phase: str):
        return bounded(phase, self.rank, self.tcfg.collective_timeout_s)

    def _moe_blocks(self) -> list:
        return [self.model.model.layers[i].mlp for i in self.stages[self.stage] if self.model.model.layers[i].is_moe]

    def _balance_router_bias(self) -> None:
        """After an optimizer step: its tokens per expert summed over the stage (`step_loads`, every rank of
        the stage the same), and with `router_bias_update_rate` > 0 each sigmoid router's correction bias
        moved toward balance (`router_bias_update`): the same update on every copy of it."""
        blocks = self._moe_blocks()
        rows = [b.step_tokens_per_expert if b.step_tokens_per_expert is not None
                else torch.zeros(self.cfg.num_experts, dtype=torch.long, device=self.device) for b in blocks]
        stats = torch.stack(rows) if rows else torch.zeros(0, self.cfg.num_experts, dtype=torch.long, device=self.device)
        self.step_loads = all_reduce(stats, self.groups.stage)
        rate = self.tcfg.router_bias_update_rate
        if rate > 0:
            with torch.no_grad():
                for block, loads in zip(blocks, self.step_loads):
                    bias = block.gate.e_score_correction_bias
                    bias.copy_(router_bias_update(bias, loads, rate))

    def router_bias_abs_max(self) -> float:
        """The largest |correction bias| on this stage (0 for softmax routers): what the bias update has done."""
        biases = [b.gate.e_score_correction_bias.abs().max() for b in self._moe_blocks()
                  if hasattr(b.gate, "e_score_correction_bias")]
        return float(max(biases)) if biases else 0.0

    def router_stats(self) -> torch.Tensor:
        """Tokens per expert per MoE layer of this stage, summed over the stage: those of the last optimizer
        step's forwards after an update (no collective then), else of the last forward (a collective)."""
        if self.step_loads is not None:
            return self.step_loads
        rows = [b.last_tokens_per_expert for b in self._moe_blocks()]
        stats = torch.stack(rows) if rows else torch.zeros(0, self.cfg.num_experts, dtype=torch.long, device=self.device)
        return all_reduce(stats, self.groups.stage)


SQUARES_BLOCK = 1 << 16  # elements made fp64 at a time (512 KB: in cache)


def squares_fp64(t: torch.Tensor) -> torch.Tensor:
    """The sum of t's squared elements in fp64 (a 0-d fp64 tensor): fp32 squares are exact in fp64, so shards of a
    gradient summed in any order give the same norm to fp64 rounding. Block by block: torch's
    `vector_norm(dtype=float64)` converts element by element (71-88 ms a [32,000, 512] gradient on one thread, 13-14
    ms so: `python -m benchmarks.cpu_kernels --only grad_norm`). Other devices, and tensors of one block: torch's."""
    flat = t.reshape(-1)
    if t.device.type != "cpu" or flat.numel() <= SQUARES_BLOCK:  # (small ones as before: the same value, bit for bit)
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    sq = torch.zeros((), dtype=torch.float64, device=t.device)
    for i in range(0, flat.numel(), SQUARES_BLOCK):
        b = flat[i:i + SQUARES_BLOCK].double()
        sq += torch.dot(b, b)
    return sq


def _checkpointed(fn):
    def run(*args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return run
