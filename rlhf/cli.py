"""The `rlhf` command.

    rlhf make-tiny DIR [--model YAML] [--seed N] [--target-accuracy F]
    rlhf check RUN.yaml [key=value ...]     validate and print the resolved config
    rlhf eval RUN.yaml [key=value ...]      score the run's policy with our model and vLLM

Commands that produce a result end with one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from enum import Enum
from pathlib import Path

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x) for x in obj]
    return obj


def _make_tiny(args) -> int:
    from rlhf.config import load_model_config
    from rlhf.tiny import TinySpec, make_tiny

    cfg = load_model_config(args.model)
    spec = TinySpec(seed=args.seed, target_accuracy=args.target_accuracy)
    summary = make_tiny(args.dir, cfg, spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in summary.items() if k != "spec"}))
    return 0


def _check(args) -> int:
    import yaml

    from rlhf.config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    print(yaml.safe_dump(_jsonable(cfg), sort_keys=False), end="")
    return 0


def _eval(args) -> int:
    from rlhf.config import load_run_config
    from rlhf.evaluate import evaluate

    cfg = load_run_config(args.config, args.overrides)
    result = evaluate(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf", description="RL post-training of MoE language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny MoE policy warm-started on the addition task")
    p.add_argument("dir", help="output HF model directory (prompt files are written beside the weights)")
    p.add_argument("--model", default=str(REPO_CONFIGS / "model" / "qwen3_moe_tiny.yaml"), help="model shape YAML")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-accuracy", type=float, default=0.2,
                   help="stop the supervised warm start once greedy held-out accuracy reaches this fraction")
    p.set_defaults(func=_make_tiny)

    for name, func, text in (("check", _check, "validate a run config and print it resolved"),
                             ("eval", _eval, "score the run's policy on its held-out prompts (torch and vLLM)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="run YAML, e.g. configs/tiny_cpu.yaml")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.tp=2")
        p.set_defaults(func=func)

    args = parser.parse_args(argv)
    from rlhf.config.validate import ConfigError
    from rlhf.data.prompts import DatasetError

    try:
        return args.func(args)
    except (ConfigError, DatasetError) as e:
        print(f"rlhf {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
