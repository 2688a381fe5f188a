"""DeployMind: a calibrated cost model of an RL step and a search over layouts and placements (docs/simulate.md).
Pure: shapes, layouts, plans and hardware descriptions in, seconds and bytes out; no torch, no Ray.

    hardware   configs/hardware/*.yaml: devices, links per level, per-phase calibration; checked on load
    workload   a model's parameter groups and per-token costs; one step's work from a run config
    candidate  what is priced: the trainer's and the engines' layouts, where they sit, the staleness bound
    cost       seconds per phase, the step (serial or overlapped)
    memory     bytes per role and device: parameters, gradients, optimizer state, activations, KV cache
    search     enumeration of training layouts, inference layouts and placements, pruned and ranked
    fit        calibration from measured runs; error and rank correlation of predictions

A run config is priced by `rlhf.report.simulate` (`rlhf simulate`), which reads its placement.
"""

from rlhf.sim.candidate import Candidate, EngineChoice, TrainerChoice
from rlhf.sim.cost import simulate_candidate
from rlhf.sim.hardware import Calibration, Hardware, Link, default_hardware, load_hardware
from rlhf.sim.workload import ModelCost, Workload, model_cost, workload

__all__ = ["Calibration", "Candidate", "EngineChoice", "Hardware", "Link", "ModelCost", "TrainerChoice", "Workload",
           "default_hardware", "load_hardware", "model_cost", "simulate_candidate", "workload"]
