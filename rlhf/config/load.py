"""Loading: schema + YAML files + `key=value` overrides -> frozen dataclass instances.

A run YAML may name other YAML files under `defaults:`, Hydra-style, one per section:

    defaults:
      model: model/qwen3_moe_tiny.yaml      # relative to this file
      placement: placement/cpu_colocated.yaml

Each named file holds that section's fields at its top level; the run file's own values for the
section are merged over it, then the command-line overrides (`trainer.tp=2`). Every source is merged
separately so that an error names the file or override it came from. Nothing is read from the
environment and no defaults are hidden in loaders: the schema holds them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rlhf.schema import ModelConfig, RunConfig
from rlhf.config.validate import validate_model, validate_run
from rlhf.errors import ConfigError

T = TypeVar("T")

DEFAULTS_KEY = "defaults"


def load_run_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a run YAML (with its `defaults:` files) and overrides; validate before returning."""
    cfg = _load(RunConfig, Path(path), overrides)
    validate_run(cfg)
    return cfg


def load_model_config(path: str | Path, overrides: Sequence[str] = ()) -> ModelConfig:
    """Load a model-shape YAML (`configs/model/*.yaml`) on its own."""
    cfg = _load(ModelConfig, Path(path), overrides)
    validate_model(cfg)
    return cfg


def load_config(schema_cls: type[T], path: str | Path, overrides: Sequence[str] = ()) -> T:
    """Load any schema dataclass (a run, or one section such as PlacementConfig) from YAML + overrides.

    Types and keys are checked here; value checks of whole runs and models are in `validate`.
    """
    return _load(schema_cls, Path(path), overrides)


def _load(schema_cls: type[T], path: Path, overrides: Sequence[str]) -> T:
    merged = OmegaConf.structured(schema_cls)
    OmegaConf.set_readonly(merged, False)
    raw = _read_yaml(path)
    defaults = raw.pop(DEFAULTS_KEY, None) or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{path}: '{DEFAULTS_KEY}' must map a section name to a YAML file, got {defaults!r}")
    section_names = {f.name for f in dataclasses.fields(schema_cls)}
    for section, rel in defaults.items():
        if section not in section_names:
            raise ConfigError(
                f"{path}: {DEFAULTS_KEY}.{section}: no such section; "
                f"use one of {sorted(n for n in section_names if _is_section(schema_cls, n))}"
            )
        sub_path = (path.parent / str(rel)).resolve()
        sub = _read_yaml(sub_path)
        merged = _merge(merged, _enum_words(schema_cls, {section: sub}), source=str(sub_path))
    merged = _merge(merged, _enum_words(schema_cls, raw), source=str(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: write overrides as key=value, for example trainer.tp=2")
        update = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        merged = _merge(merged, _enum_words(schema_cls, update), source=f"override {item!r}")
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # a required value left missing
        raise ConfigError(f"{path}: {_describe(e)}") from None


def as_dict(cfg) -> Any:
    """A config as plain YAML/JSON values (enums by value, tuples as lists): for printing and tracking."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: as_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Enum):
        return cfg.value
    if isinstance(cfg, (list, tuple)):
        return [as_dict(x) for x in cfg]
    return cfg


def _is_section(schema_cls: type, name: str) -> bool:
    f = next(f for f in dataclasses.fields(schema_cls) if f.name == name)
    return dataclasses.is_dataclass(f.default_factory) if f.default_factory is not dataclasses.MISSING else False


def _enum_words(schema_cls: type, data: Any) -> Any:
    """YAML 1.1 reads `off` / `on` (also `no`, `yes`) as booleans; where the schema expects an enum with an
    `off` or `on` member (`trainer.routing_replay: off`), the word was meant. Returns `data` mended."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(schema_cls):
        return data
    hints = typing.get_type_hints(schema_cls)
    out = {}
    for key, value in data.items():
        kind = hints.get(key) if isinstance(key, str) else None
        if isinstance(kind, type) and issubclass(kind, Enum) and isinstance(value, bool):
            word = "on" if value else "off"
            value = word if word in kind.__members__ else value
        elif dataclasses.is_dataclass(kind):
            value = _enum_words(kind, value)
        out[key] = value
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys to values, got {type(data).__name__}")
    return data


def _merge(base: DictConfig, update: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: {_describe(e, base)}") from None
    except TypeError:  # OmegaConf names no key for a mapping given where a list belongs, or the reverse
        key, want, got = _container_clash(base, update)
        raise ConfigError(f"{source}: {key}: expected a {want}, got a {got}") from None


def _container_clash(base: Any, update: Any, prefix: str = "") -> tuple[str, str, str]:
    """The first key where `update` holds a mapping and `base` a list, or the reverse: (key, wanted, given)."""
    def kind(v):
        if isinstance(v, dict) or OmegaConf.is_dict(v):
            return "mapping"
        # lists, tuples and OmegaConf's list-like nodes (ListConfig, TupleConfig)
        return "list" if hasattr(v, "__len__") and not isinstance(v, (str, bytes)) else None
    if isinstance(update, dict) and isinstance(base, DictConfig):
        for k, v in update.items():
            key = f"{prefix}{k}"
            b = base.get(k) if k in base else None
            if kind(b) and kind(v) and kind(b) != kind(v):
                return key, kind(b), kind(v)
            if isinstance(v, dict) and isinstance(b, DictConfig):
                found = _container_clash(b, v, f"{key}.")
                if found[0] != "?":
                    return found
    return "?", "value of another kind", "mapping or list"


def _describe(e: OmegaConfBaseException, base: DictConfig | None = None) -> str:
    """Turn OmegaConf's message into: key, value seen, what to change."""
    key = getattr(e, "full_key", None) or "?"
    first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ConfigKeyError) and base is not None:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(base, parent_key) if parent_key else base
        known = sorted(parent.keys()) if isinstance(parent, DictConfig) else []
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return f"unknown key '{key}'; {hint}known keys here: {', '.join(map(str, known))}"
    return f"{key}: {first_line}"
