"""What the simulator prices: one configuration as value objects, the trainer's layout (`TrainerChoice`),
the engines' (`EngineChoice`) and where they sit with the loop's staleness bound (`Candidate`). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.schema import RolloutConfig, TrainerConfig
from rlhf.sharding.layout import InferenceLayout, Layout


@dataclass(frozen=True)
class TrainerChoice:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    experts_over_tp_ep: bool = False
    zero_stage: int = 1
    recompute: bool = False  # attention and experts recomputed in backward
    micro_batch_tokens: int = 4096
    hierarchical_ep: bool = False  # the expert all-to-all in two hops (inter-node once per node, then inside)

    # world and expert_shards are rlhf.sharding.layout.Layout's rules, inlined: the search reads them per candidate
    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def expert_shards(self) -> int:
        return self.ep * self.tp if self.experts_over_tp_ep else self.ep

    def __str__(self) -> str:
        lay = Layout(self.pp, self.dp, self.tp, self.ep, self.experts_over_tp_ep)
        return (f"{lay}" + (f" zero{self.zero_stage}" if self.zero_stage != 1 else "")
                + (" recompute" * self.recompute) + f" mb{self.micro_batch_tokens}"
                + (" hierarchical-ep" * self.hierarchical_ep))


@dataclass(frozen=True)
class EngineChoice:
    tp: int = 1
    ep: int = 1
    engines: int = 1
    redundant_experts: int = 0

    @property
    def ranks(self) -> int:  # rlhf.sharding.layout.InferenceLayout.ranks_per_engine, inlined (read per candidate)
        return self.tp if self.ep == 1 else self.ep

    @property
    def world(self) -> int:
        return self.ranks * self.engines

    def __str__(self) -> str:
        return str(InferenceLayout(self.tp, self.ep, self.engines, self.redundant_experts))


@dataclass(frozen=True)
class Candidate:
    """One configuration: the two layouts, where they sit, and the loop's staleness bound."""

    trainer: TrainerChoice
    engines: EngineChoice
    colocated: bool = True
    trainer_devices: int = 0  # devices of the trainer pool (0: the trainer's world size)
    rollout_devices: int = 0
    staleness: int = 0
    quantization: str = "none"  # the engines' weights (rollout.quantization)
    # co-located engines that never sleep (rollout.sleep_level 0): under StaleSync they generate beside the
    # trainer's work instead of taking turns with it (docs/stale_sync.md, "Co-located placements")
    awake: bool = False

    @property
    def devices(self) -> int:
        t = self.trainer_devices or self.trainer.world
        r = self.rollout_devices or self.engines.world
        return max(t, r) if self.colocated else t + r

    @property
    def rollout_first_device(self) -> int:
        return 0 if self.colocated else (self.trainer_devices or self.trainer.world)

    def __str__(self) -> str:
        where = "co-located" if self.colocated else f"disaggregated {self.trainer_devices or self.trainer.world}+" \
                                                    f"{self.rollout_devices or self.engines.world}"
        return (f"trainer {self.trainer}, engines {self.engines}"
                + (f" {self.quantization}" if self.quantization != "none" else "") + f", {where}"
                + (f", staleness {self.staleness}" if self.staleness else "")
                + (", engines awake" if self.awake and self.colocated and self.staleness else ""))


def trainer_choice(t: TrainerConfig) -> TrainerChoice:
    """The trainer's layout of a run config, as the simulator prices it."""
    return TrainerChoice(t.pp, t.dp, t.tp, t.ep, t.experts_over_tp_ep, t.zero_stage, bool(t.recompute),
                         t.micro_batch_tokens, t.hierarchical_ep)


def engine_choice(r: RolloutConfig) -> EngineChoice:
    """The engines' layout of a run config."""
    return EngineChoice(r.tp, r.ep, r.num_engines)
