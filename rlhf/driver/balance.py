"""Expert-parallel load balancing in the run (trainer.expert_balance, docs/expert_balance.md): the
`ExpertBalancing` part of `Run`. Each step's expert loads move the prediction on; every `every_steps` steps
each MoE layer's placement is planned from it (`rlhf.expert_balance`), the trainer ranks migrate their experts
with their optimizer state (`ParallelTrainer.migrate_experts`), and the weight sync follows the new maps.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from actors.replies import UpdateReply
from rlhf.driver.metrics import expert_parallel_load
from rlhf.layout import default_expert_map


class ExpertBalancing:
    """Mixed into `rlhf.driver.run.Run`, whose fields it uses (cfg, inputs, roles, expert_maps, load_prediction,
    load_metrics, log, phase)."""

    def current_expert_maps(self) -> tuple[tuple[int, ...], ...]:
        """The trainer's expert -> EP shard map of every MoE layer."""
        if self.expert_maps is not None:
            return self.expert_maps
        m = self.cfg.model
        return (default_expert_map(m.num_experts, self.inputs.sync.trainer.expert_shards),) * (
            m.num_hidden_layers - m.first_k_dense_layers)

    def observe_expert_loads(self, updates: list[UpdateReply]) -> None:
        """The step's expert-parallel load metrics (logged by `record`), and the load prediction moved on."""
        b = self.cfg.trainer.expert_balance
        self.load_metrics, self.load_prediction = expert_parallel_load(
            updates, self.current_expert_maps(), self.inputs.sync.trainer.expert_shards, self.load_prediction,
            b.theta)

    def balance_experts(self, step: int) -> None:
        """Expert-parallel load balancing (trainer.expert_balance, docs/expert_balance.md): every `every_steps`
        steps each MoE layer's placement is planned from the load prediction (`rlhf.expert_balance.plan`);
        when a layer's plan pays (min_cv_drop), every trainer rank moves its experts with their optimizer
        state; engines with ep > 1 take a placement planned from the same prediction the same way
        (`rlhf.expert_balance.engine_plan`), installed with the next sync; the weight-sync plan is rebuilt for
        both sides' new maps. Its metrics join the step's expert_load/*."""
        b = self.cfg.trainer.expert_balance
        if not b.enabled or step % b.every_steps or self.load_prediction is None:
            return
        from rlhf.expert_balance import plan

        t0 = time.time()
        p = plan(self.load_prediction, self.current_expert_maps(), self.inputs.sync.trainer.expert_shards,
                 b.min_cv_drop)
        m = p.metrics() | {"time/expert_balance_plan": time.time() - t0, "expert_balance/bytes_moved": 0,
                           "time/expert_balance_sync_plan": 0.0}
        engines = self._engine_placement_plan(b.min_cv_drop)
        replaced = 0 if engines is None else sum(x != y for x, y in zip(self.current_engine_experts(), engines))
        if engines is not None:
            m["expert_balance/engine_layers_replaced"] = replaced
        if p.experts_moved:
            with self.phase("expert migration", step):
                replies = self.roles.all(self.roles.trainer, "migrate_experts", p.maps)
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
                                  engines if replaced else self.engine_experts)
            m["time/expert_balance_sync_plan"] = time.time() - t1
        self.load_metrics |= m

    def current_engine_experts(self) -> tuple[tuple[int, ...], ...]:
        """The logical expert of every physical slot of the engines, per MoE layer."""
        if self.engine_experts is not None:
            return self.engine_experts
        return tuple(v for _, v in sorted(self.inputs.sync.engine_physical().items()))

    def _engine_placement_plan(self, min_cv_drop: float) -> Optional[tuple]:
        """The engines' placement from the same predictions (engines with ep > 1 and no redundant slots: vLLM's
        EPLB places those), or None where the engines do not follow."""
        lay = self.inputs.sync.engines
        if lay.ep == 1 or lay.redundant_experts:
            return None
        from rlhf.expert_balance import engine_plan

        return engine_plan(self.load_prediction, self.current_engine_experts(), lay.ep, min_cv_drop)

    def _set_expert_maps(self, maps: Optional[tuple], engine_experts: Optional[tuple] = None) -> None:
        """The trainer's expert maps or the engines' placement changed (a migration, or a checkpoint restored):
        the weight sync's specs and plan follow them (plan time is in time/expert_balance_sync_plan)."""
        if maps == self.expert_maps and engine_experts == self.engine_experts:
            return
        self.expert_maps, self.engine_experts = maps, engine_experts
        sync = replace(self.inputs.sync, expert_maps=maps, engine_experts=engine_experts)
        self.inputs = replace(self.inputs, sync=sync, plan=sync.plan())
        if self.roles is not None:
            self.roles.sync_layout = sync
