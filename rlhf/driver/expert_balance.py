"""Expert-parallel load balancing in the run (trainer.expert_balance, docs/expert_balance.md): the
`ExpertBalance` component of `Run`. Each step's expert loads move the prediction on; every `every_steps` steps
each MoE layer's placement is planned from it (`rlhf.moe.balance`), the trainer ranks migrate their experts
with their optimizer state (`ParallelTrainer.migrate_experts`), and the weight sync follows the new maps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from actors.replies import UpdateReply
from rlhf.driver.metrics import expert_parallel_load
from rlhf.sharding.layout import default_expert_map
from rlhf.schema import RunConfig


@dataclass
class ExpertBalance:
    """The load prediction and the placements it led to (all checkpointed), and this step's load metrics.
    `weights`: the run's `WeightSync`, which follows every placement change."""

    cfg: RunConfig
    weights: object  # rlhf.driver.run.WeightSync
    log: Callable[[str], None]
    phase: Callable  # the run's phase timer (`Recorder.phase`)
    load_prediction: Optional[list] = None  # tokens per expert per MoE layer, moving average (expert_load/*)
    load_metrics: dict = field(default_factory=dict)  # this step's expert_load/* from `observe`
    expert_maps: Optional[tuple] = None  # the trainer's expert -> EP shard map per MoE layer once balanced
    engine_experts: Optional[tuple] = None  # the engines' placement per MoE layer once it follows

    def state(self) -> dict:
        """What a checkpoint keeps (`restore` reads it back)."""
        return {"expert_load_prediction": self.load_prediction,
                "expert_maps": [list(m) for m in self.expert_maps] if self.expert_maps else None,
                "engine_experts": [list(m) for m in self.engine_experts] if self.engine_experts else None}

    def restore(self, state: dict, roles) -> None:
        """A checkpoint's state (`state`): the trainer ranks restored the same placement from their files; the
        engines take theirs with the next sync."""
        self.load_prediction = state.get("expert_load_prediction")  # none in checkpoints written before it
        maps, engines = state.get("expert_maps"), state.get("engine_experts")
        self._set_expert_maps(tuple(tuple(m) for m in maps) if maps else None,
                              tuple(tuple(m) for m in engines) if engines else None, roles)

    def take_metrics(self) -> dict:
        """This step's expert_load/* and expert_balance/* metrics (then none until the next step)."""
        m, self.load_metrics = self.load_metrics, {}
        return m

    def current_expert_maps(self) -> tuple[tuple[int, ...], ...]:
        """The trainer's expert -> EP shard map of every MoE layer."""
        if self.expert_maps is not None:
            return self.expert_maps
        m = self.cfg.model
        return (default_expert_map(m.num_experts, self.weights.layout.trainer.expert_shards),) * (
            m.num_hidden_layers - m.first_k_dense_layers)

    def observe(self, updates: list[UpdateReply]) -> None:
        """The step's expert-parallel load metrics (logged by `record`), and the load prediction moved on."""
        b = self.cfg.trainer.expert_balance
        self.load_metrics, self.load_prediction = expert_parallel_load(
            updates, self.current_expert_maps(), self.weights.layout.trainer.expert_shards, self.load_prediction,
            b.theta)

    def balance(self, step: int, roles) -> None:
        """Expert-parallel load balancing (trainer.expert_balance, docs/expert_balance.md): every `every_steps`
        steps each MoE layer's placement is planned from the load prediction (`rlhf.moe.balance.plan`);
        when a layer's plan pays (min_cv_drop), every trainer rank moves its experts with their optimizer
        state; engines with ep > 1 take a placement planned from the same prediction the same way
        (`rlhf.moe.balance.engine_plan`), installed with the next sync; the weight-sync plan is rebuilt for
        both sides' new maps. Its metrics join the step's expert_load/*."""
        b = self.cfg.trainer.expert_balance
        if not b.enabled or step % b.every_steps or self.load_prediction is None:
            return
        from rlhf.moe.balance import plan

        t0 = time.time()
        p = plan(self.load_prediction, self.current_expert_maps(), self.weights.layout.trainer.expert_shards,
                 b.min_cv_drop)
        m = p.metrics() | {"time/expert_balance_plan": time.time() - t0, "expert_balance/bytes_moved": 0,
                           "time/expert_balance_sync_plan": 0.0}
        engines = self._engine_placement_plan(b.min_cv_drop)
        replaced = 0 if engines is None else sum(x != y for x, y in zip(self.current_engine_experts(), engines))
        if engines is not None:
            m["expert_balance/engine_layers_replaced"] = replaced
        if p.experts_moved:
            with self.phase("expert migration", step):
                replies = roles.all(roles.trainer, "migrate_experts", p.maps)
            m["expert_balance/bytes_moved"] = sum(r["bytes_sent"] for r in replies)
            moved = [lp for lp in p.layers if lp.migrate]
            self.log(f"step {step}: expert balance: {len(moved)} MoE layers migrated, {p.experts_moved} experts "
                     f"moved ({m['expert_balance/bytes_moved'] / 1e6:.1f} MB with their AdamW moments); predicted "
                     f"per-rank load CV " + ", ".join(f"layer {lp.layer} {lp.cv_before:.3f}->{lp.cv_after:.3f}"
                                                      for lp in moved))
        if replaced:
            self.log(f"step {step}: expert balance: the engines re-place {replaced} MoE layers' experts (installed "
                     f"with the next sync)")
        if p.experts_moved or replaced:
            t1 = time.time()
            self._set_expert_maps(p.maps if p.experts_moved else self.expert_maps,
                                  engines if replaced else self.engine_experts, roles)
            m["time/expert_balance_sync_plan"] = time.time() - t1
        self.load_metrics |= m

    def current_engine_experts(self) -> tuple[tuple[int, ...], ...]:
        """The logical expert of every physical slot of the engines, per MoE layer."""
        if self.engine_experts is not None:
            return self.engine_experts
        return tuple(v for _, v in sorted(self.weights.layout.engine_physical().items()))

    def _engine_placement_plan(self, min_cv_drop: float) -> Optional[tuple]:
        """The engines' placement from the same predictions (engines with ep > 1 and no redundant slots: vLLM's
        EPLB places those), or None where the engines do not follow."""
        lay = self.weights.layout.engines
        if lay.ep == 1 or lay.redundant_experts:
            return None
        from rlhf.moe.balance import engine_plan

        return engine_plan(self.load_prediction, self.current_engine_experts(), lay.ep, min_cv_drop)

    def _set_expert_maps(self, maps: Optional[tuple], engine_experts: Optional[tuple], roles) -> None:
        """The trainer's expert maps or the engines' placement changed (a migration, or a checkpoint restored):
        the weight sync's specs and plan follow them (plan time is in time/expert_balance_sync_plan)."""
        if maps == self.expert_maps and engine_experts == self.engine_experts:
            return
        self.expert_maps, self.engine_experts = maps, engine_experts
        self.weights.follow(maps, engine_experts, roles)
