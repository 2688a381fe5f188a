"""The environment interface: what a user writes to train a policy on multi-turn, tool-using episodes.

An environment is made per episode from its class (named in the run's YAML as `module:Class` with keyword
arguments), given the episode's data row at `reset`, and then each model turn's text at `step`; it answers with
an `Observation`: text (or token ids) the model reads next, an optional reward, and whether the episode is over.
Text only ever goes to the environment; the episode itself stays token ids (`rlhf.agents.episode`).

    class Echo:
        stop = ("</call>",)              # strings that end a model turn besides EOS (a tool call's end)

        def reset(self, row) -> None:    # row: rlhf.data.prompts.PromptRow (prompt, answer, source)
            self.answer = row.answer

        def step(self, text: str) -> Observation:
            if text.endswith("</call>"):
                return Observation(text="<out>...</out>")
            return Observation(done=True, reward=float(self.answer in text))
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

from rlhf.errors import ConfigError


@dataclass(frozen=True)
class Observation:
    """What the environment answers a model turn with. `text` is tokenized on its own and appended to the
    episode (or `token_ids` appended as they are); `reward` is the episode's reward when `done` (None: 0)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    reward: float | None = None
    done: bool = False


class Environment(Protocol):
    stop: Sequence[str]

    def reset(self, row: Any) -> None: ...

    def step(self, text: str) -> Observation: ...


def check_observation(obs: Any, env: Any) -> Observation:
    """`obs` as an Observation, or a ValueError naming the environment and what it returned instead."""
    name = type(env).__qualname__
    if not isinstance(obs, Observation):
        raise ValueError(f"environment {name}.step returned {type(obs).__name__}, not an "
                         "rlhf.agents.environment.Observation(text=... or token_ids=..., reward=..., done=...)")
    if obs.text is not None and not isinstance(obs.text, str):
        raise ValueError(f"environment {name}.step returned text of type {type(obs.text).__name__}: give a str")
    if obs.token_ids is not None and not all(isinstance(t, int) and t >= 0 for t in obs.token_ids):
        raise ValueError(f"environment {name}.step returned token_ids that are not all non-negative ints")
    if obs.text is not None and obs.token_ids is not None:
        raise ValueError(f"environment {name}.step returned both text and token_ids: give one")
    if not isinstance(obs.done, bool):
        raise ValueError(f"environment {name}.step returned done={obs.done!r}: give True or False")
    if obs.reward is not None and (isinstance(obs.reward, bool) or not isinstance(obs.reward, (int, float))
                                   or not math.isfinite(obs.reward)):
        raise ValueError(f"environment {name}.step returned reward={obs.reward!r}: give a finite number or None")
    if not obs.done and obs.text is None and obs.token_ids is None:
        raise ValueError(f"environment {name}.step returned an observation with neither text nor token_ids and "
                         "done=False: the model would have nothing new to read")
    return obs


def import_named(spec: str, kind: str, example: str) -> Any:
    """The object `module:name` names (an environment class, an agent function), or a ConfigError saying what to
    change: the spec's form, a module that does not import, a name it does not have."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"give 'module:{kind}', e.g. '{example}', not {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"module {module_name!r} does not import "
                          f"({type(e).__name__}: {e}); is it installed or on PYTHONPATH?") from e
    obj = getattr(module, attr, None)
    if obj is None:
        raise ConfigError(f"{module_name} has no {kind.lower()} {attr!r}")
    return obj


def load_environment(spec: str, kwargs: Mapping[str, Any] | None = None) -> Callable[[], Any]:
    """A factory of fresh environments from `module:Class` and keyword arguments: importable, a class with
    `reset` and `step` and a `stop` sequence, and made once here so that bad arguments fail now (before any
    actor starts), with what to change. The messages name what to change in the spec and its arguments; the run's
    validation reports them under `agent.environment`."""
    cls = import_named(spec, "Class", "rlhf.agents.calculator:Calculator")
    module_name, _, attr = spec.partition(":")
    if not inspect.isclass(cls):
        raise ConfigError(f"{module_name} has no class {attr!r} (it is a {type(cls).__name__})")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{attr} has no {' or '.join(missing)} method "
                          "(an environment implements reset(row) and step(text) -> Observation)")
    kwargs = dict(kwargs or {})
    try:
        probe = cls(**kwargs)
    except Exception as e:
        raise ConfigError(f"making one with arguments {kwargs} failed "
                          f"({type(e).__name__}: {e}); fix agent.environment_args") from e
    stop = getattr(probe, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(f"its stop must be a sequence of non-empty strings "
                          f"(a tool call's end), not {stop!r}")
    return lambda: cls(**kwargs)
