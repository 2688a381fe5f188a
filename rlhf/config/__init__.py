"""Loading a run's configuration (`load`: YAML files + `key=value` overrides into the schema's dataclasses)
and checking it whole (`validate`: values, layouts against the model, placement), before anything starts.
The schema itself is `rlhf.schema`, re-exported here."""

from rlhf.config.load import load_config, load_model_config, load_run_config
from rlhf.errors import ConfigError
from rlhf.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    PlacementConfig,
    RolloutConfig,
    RunConfig,
    TrackingConfig,
    TrainerConfig,
)

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "ModelConfig", "PlacementConfig",
    "RolloutConfig", "RunConfig", "TrackingConfig", "TrainerConfig", "load_config", "load_model_config", "load_run_config",
]
