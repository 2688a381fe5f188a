"""The `rlhf` command.

    rlhf make-tiny DIR [--model YAML|NAME] [--seed N] [--target-accuracy F] [--lr F] [--init-std F]
    rlhf check RUN.yaml [key=value ...]     validate and print the resolved config
    rlhf eval RUN.yaml [key=value ...]      score the run's policy with our model and vLLM
    rlhf plan RUN.yaml [key=value ...]      device map, memory per device and per role, weight-sync plan
    rlhf train RUN.yaml [key=value ...]     the RL run; on a cluster: ray job submit -- rlhf train RUN.yaml
    rlhf simulate RUN.yaml [--hardware H] [--search [--devices N] [--top K] [--write DIR]] [key=value ...]
                                            predicted step, phases, memory; the best layouts (starts nothing)
    rlhf calibrate --out FILE               measure this machine as a hardware description for `simulate`

Commands that produce a result end with one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _make_tiny(args) -> int:
    from rlhf.config import load_model_config
    from rlhf.errors import ConfigError
    from rlhf.tiny import TinySpec, make_tiny, sft_init_std, sft_lr, sft_max_steps

    path = Path(args.model)
    if not path.is_file() and (REPO_CONFIGS / "model" / f"{args.model}.yaml").is_file():
        path = REPO_CONFIGS / "model" / f"{args.model}.yaml"  # a shipped model by name, e.g. pangu_moe_tiny
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (REPO_CONFIGS / "model").glob("*.yaml")))
        raise ConfigError(f"--model {args.model}: no such YAML file and no model of that name under configs/model "
                          f"({names})")
    if args.lr is not None and args.lr <= 0:
        raise ConfigError(f"--lr {args.lr}: the learning rate must be positive, e.g. 1e-3")
    if args.init_std is not None and args.init_std <= 0:
        raise ConfigError(f"--init-std {args.init_std}: the standard deviation must be positive, e.g. 0.02")
    cfg = load_model_config(path)
    target = args.target_accuracy if args.target_accuracy is not None else 0.5 if args.task == "tool" else 0.2
    spec = TinySpec(seed=args.seed, target_accuracy=target, lr=sft_lr(cfg) if args.lr is None else args.lr,
                    max_sft_steps=sft_max_steps(cfg),
                    init_std=sft_init_std(cfg) if args.init_std is None else args.init_std, task=args.task)
    summary = make_tiny(args.dir, cfg, spec, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps({k: v for k, v in summary.items() if k != "spec"}))
    return 0


def _check(args) -> int:
    import yaml

    from rlhf.config import load_run_config
    from rlhf.config.load import as_dict

    cfg = load_run_config(args.config, args.overrides)
    print(yaml.safe_dump(as_dict(cfg), sort_keys=False), end="")
    return 0


def _eval(args) -> int:
    from rlhf.config import load_run_config
    from rlhf.driver.evaluate import evaluate

    cfg = load_run_config(args.config, args.overrides)
    result = evaluate(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result))
    return 0


def _train(args) -> int:
    from rlhf.config import load_run_config
    from rlhf.driver import train

    cfg = load_run_config(args.config, args.overrides)
    result = train(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(result))
    return 0


def _plan(args) -> int:
    from rlhf.config import load_run_config
    from rlhf.placement import device_map
    from rlhf.report import memory_by_role, plan_report
    from rlhf.sim import default_hardware, load_hardware

    cfg = load_run_config(args.config, args.overrides)  # validates the placement too
    # the memory model on the device type's hardware file: activations, KV cache and runtime per role
    simulated = memory_by_role(cfg, load_hardware(default_hardware(cfg.placement.device_type.value)))
    lines, result = plan_report(cfg, device_map(cfg), simulated=simulated)
    print("\n".join(lines), file=sys.stderr, flush=True)
    print(json.dumps(result))
    return 0


def _simulate(args) -> int:
    from rlhf.config import load_run_config
    from rlhf.errors import ConfigError
    from rlhf.report import search_config, simulate, write_config
    from rlhf.sim import default_hardware, load_hardware
    from rlhf.schema import RewardKind
    from rlhf.report.simulate import search_lines, simulate_lines

    cfg = load_run_config(args.config, args.overrides)
    for name in ("prompt_tokens", "response_tokens", "devices", "top"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {v}: must be > 0")
    if args.max_staleness < 0:
        raise ConfigError(f"--max-staleness {args.max_staleness}: the largest staleness bound to try, >= 0 "
                          f"(0: synchronous configurations only)")
    if args.expert_load_skew < 1:
        raise ConfigError(f"--expert-load-skew {args.expert_load_skew}: the busiest expert rank's load over the mean "
                          f"is >= 1 (1: uniform routing)")
    if args.reward_seconds < 0:
        raise ConfigError(f"--reward-seconds {args.reward_seconds}: a verifier's seconds per sample, >= 0 "
                          f"(0: the hardware file's reward cost)")
    if (args.devices or args.write) and not args.search:
        raise ConfigError("--devices and --write go with --search")
    if cfg.reward.kind is RewardKind.code and not args.reward_seconds:
        print("note: reward.kind = code runs programs: the hardware file prices a rule verifier's microseconds; "
              "measure the sandbox (python -m benchmarks.sandbox_bench --processes "
              f"{cfg.reward.sandbox.processes}) and pass its seconds per sample as --reward-seconds", file=sys.stderr)
    hw = load_hardware(args.hardware or default_hardware(cfg.placement.device_type.value))
    lengths = dict(prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
                   expert_load_skew=args.expert_load_skew, reward_sample_seconds=args.reward_seconds)
    if not args.search:
        result = simulate(cfg, hw, plan=not args.no_plan, **lengths)
        print("\n".join(simulate_lines(cfg, result)), file=sys.stderr, flush=True)
        print(json.dumps(result))
        return 0
    found = search_config(cfg, hw, args.devices, args.top or 5, max_staleness=args.max_staleness, **lengths)
    print("\n".join(search_lines(found)), file=sys.stderr, flush=True)
    best = [{"configuration": str(r.candidate), **r.result} for r in found["ranked"]]
    out = {k: v for k, v in found.items() if k != "ranked"} | {"best": best}
    if args.write and found["ranked"]:
        run, placement = write_config(cfg, found["ranked"][0].candidate, hw, args.write)
        print(f"wrote {run} and {placement}: rlhf plan {run}", file=sys.stderr)
        out["written"] = [str(run), str(placement)]
    print(json.dumps(out))
    return 0


def _calibrate(args) -> int:
    from rlhf.driver.calibrate import calibrate
    from rlhf.sim.hardware import hardware_to_dict

    hw = calibrate(args.out, threads=args.threads, vllm=not args.no_vllm,
                   log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(hardware_to_dict(hw)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlhf", description="RL post-training of MoE language models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="write a tiny MoE policy warm-started on the addition task")
    p.add_argument("dir", help="output HF model directory (prompt files are written beside the weights)")
    p.add_argument("--model", default=str(REPO_CONFIGS / "model" / "qwen3_moe_tiny.yaml"),
                   help="model shape YAML, or the name of one under configs/model (qwen3_moe_tiny, pangu_moe_tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="stop the supervised warm start once greedy held-out accuracy reaches this fraction (default "
                        "0.2; the tool task: 0.5 of episodes that call the calculator)")
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW learning rate of the warm start (default: 3e-3 for Qwen3-MoE, 1e-3 for pangu_moe)")
    p.add_argument("--init-std", type=float, default=None,
                   help="standard deviation of the random start (default: 0.02, 0.1 for MLA attention as pangu_moe has)")
    p.add_argument("--task", choices=("add", "code", "tool"), default="add",
                   help="add: answer with the sum; code: with a program printing it, scored by reward.kind=code "
                        "(docs/code_reward.md); tool: call the calculator for sums of up to 5 digits and copy its "
                        "result (docs/agents.md)")
    p.set_defaults(func=_make_tiny)

    for name, func, text in (("check", _check, "validate a run config and print it resolved"),
                             ("plan", _plan, "print the device map, memory estimate and weight-sync plan"),
                             ("train", _train, "run RL training (embedded local Ray unless RAY_ADDRESS is set)"),
                             ("eval", _eval, "score the run's policy on its held-out prompts (torch and vLLM)")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="run YAML, e.g. configs/tiny_cpu.yaml")
        p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.tp=2")
        p.set_defaults(func=func)

    p = sub.add_parser("simulate", help="predict a run's step on a hardware description; --search for the best layouts")
    p.add_argument("config", help="run YAML, e.g. configs/cm384_pangu718b.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.tp=8")
    p.add_argument("--hardware", help="hardware YAML or a name under configs/hardware (default: by the placement's "
                                      "device type: cpu_2core, h800 for cuda, cm384 for npu)")
    p.add_argument("--search", action="store_true", help="search layouts and placements, rank by tokens/s")
    p.add_argument("--devices", type=int, help="devices to search over (default: the placement's)")
    p.add_argument("--top", type=int, help="configurations to print (default 5)")
    p.add_argument("--write", help="directory to write the best configuration to (run.yaml, placement.yaml)")
    p.add_argument("--max-staleness", type=int, default=1, help="largest StaleSync bound the search tries")
    p.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default: data.max_prompt_tokens)")
    p.add_argument("--response-tokens", type=float, help="mean generated tokens (default: rollout.max_new_tokens)")
    p.add_argument("--expert-load-skew", type=float, default=1.0,
                   help="busiest expert-parallel rank's load over the mean (the run's expert-load metrics)")
    p.add_argument("--reward-seconds", type=float, default=0.0,
                   help="a verifier's measured seconds per sample (a code sandbox, a judge), spread over reward.workers")
    p.add_argument("--no-plan", action="store_true", help="estimate the sync's bytes instead of planning it")
    p.set_defaults(func=_simulate)

    p = sub.add_parser("calibrate", help="measure this machine as a hardware description (a minute or two)")
    p.add_argument("--out", required=True, help="hardware YAML to write, e.g. configs/hardware/cpu_2core.yaml")
    p.add_argument("--threads", type=int, default=1, help="threads of one stand-in device (placement.cpus_per_device)")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM decode-step measurement")
    p.set_defaults(func=_calibrate)

    args, extra = parser.parse_known_args(argv)
    # key=value overrides after an option (`rlhf simulate RUN.yaml --search trainer.pp=4`) join the others
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from actors.remote import RoleError
    from rlhf.errors import ConfigError, EngineRestartsExhausted, PolicyRestartRefused, ShortBatch
    from rlhf.data.prompts import DatasetError

    try:
        return args.func(args)
    except (ConfigError, DatasetError) as e:
        print(f"rlhf {args.command}: {e}", file=sys.stderr)
        return 2
    except (RoleError, EngineRestartsExhausted, PolicyRestartRefused) as e:  # a role failed, timed out or died
        print(f"rlhf {args.command}: {e}", file=sys.stderr)  # (beyond what the run survives): role, rank, method
        return 1
    except ShortBatch as e:  # dynamic sampling out of draws, with algorithm.fail_short_batch
        print(f"rlhf {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
