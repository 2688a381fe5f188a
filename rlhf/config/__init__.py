"""Typed configuration: the schema (`schema`), its loader (`load`) and value checks (`validate`)."""

from rlhf.config.load import load_config, load_model_config, load_run_config
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
from rlhf.errors import ConfigError

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "ConfigError", "DataConfig", "ModelConfig", "PlacementConfig",
    "RolloutConfig", "RunConfig", "TrackingConfig", "TrainerConfig", "load_config", "load_model_config", "load_run_config",
]
