"""DeployMind: a calibrated cost model of an RL step and a search over layouts and placements (docs/simulate.md).
Pure: shapes, layouts, plans and hardware descriptions in, seconds and bytes out; no torch, no Ray.

    hardware   configs/hardware/*.yaml: devices, links per level, per-phase calibration; checked on load
    workload   a model's parameter groups and per-token costs; one step's work from a run config
    candidate  what is priced: the trainer's and the engines' layouts, where they sit, the staleness bound
    cost       seconds per phase, the step (serial or overlapped)
    memory     bytes per role and device: parameters, gradients, optimizer state, activations, KV cache
    search     enumeration of training layouts, inference layouts and placements, pruned and ranked
    fit        calibration from measured runs; error and rank correlation of predictions
    report     `rlhf simulate`: a run config's prediction, the search's ranking, the best written as YAML
"""

from rlhf.sim.candidate import Candidate, EngineChoice, TrainerChoice
from rlhf.sim.cost import simulate_candidate
from rlhf.sim.hardware import Calibration, Hardware, Link, default_hardware, load_hardware
from rlhf.sim.report import candidate_of, search_config, simulate, write_config
from rlhf.sim.workload import ModelCost, Workload, model_cost, workload

__all__ = ["Calibration", "Candidate", "EngineChoice", "Hardware", "Link", "ModelCost", "TrainerChoice", "Workload",
           "candidate_of", "default_hardware", "load_hardware", "model_cost", "search_config", "simulate",
           "simulate_candidate", "workload", "write_config"]
