"""`rlhf simulate`'s report: a run config as the simulator's candidate, its prediction as lines and one JSON dict, the
search's ranking, and the best configuration written as run.yaml + placement.yaml. Pure (plans the
weight sync for a single run, as `rlhf plan` does; starts nothing)."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from rlhf.config.load import as_dict
from rlhf.placement.device_map import device_map
from rlhf.placement.devices import format_devices
from rlhf.schema import RunConfig
from rlhf.sim.candidate import Candidate, engine_choice, trainer_choice
from rlhf.sim.cost import Sync, simulate_candidate
from rlhf.sim.hardware import Hardware
from rlhf.sim.memory import (GIB, engine_memory, engine_rank_weight_bytes, reference_memory, trainer_memory,
                              trainer_state_bytes)
from rlhf.sim.search import SearchSpace, search, why
from rlhf.sim.workload import model_cost, workload

RECOMPUTE_ALL = ("attention", "experts")


def candidate_of(cfg: RunConfig) -> Candidate:
    """The configuration a run config describes."""
    dm = device_map(cfg)
    td, rd = set(dm.devices_of("trainer")), set(dm.devices_of("rollout"))
    return Candidate(trainer_choice(cfg.trainer), engine_choice(cfg.rollout), colocated=bool(td & rd),
                     trainer_devices=len(td), rollout_devices=len(rd), staleness=cfg.stale_sync.max_staleness,
                     quantization=cfg.rollout.quantization.value, awake=cfg.rollout.sleep_level == 0)


def _plan_sync(cfg: RunConfig) -> Sync:
    from rlhf.placement.transfer import sync_layout

    sync = sync_layout(cfg, device_map(cfg))
    s = sync.plan().summary(sync.topology)
    return Sync(max_recv_bytes=s["max_recv_bytes"], max_send_bytes=s["max_send_bytes"])


def simulate(cfg: RunConfig, hw: Hardware, prompt_tokens: float | None = None, response_tokens: float | None = None,
             expert_load_skew: float = 1.0, plan: bool = True, reward_sample_seconds: float = 0.0) -> dict:
    """The prediction for `cfg` on `hw`: seconds per phase, the step, tokens/s, memory, whether it fits. With
    `plan`, the sync's bytes come from the real resharding plan (the one `rlhf plan` prints)."""
    w = workload(cfg, prompt_tokens, response_tokens, expert_load_skew, reward_sample_seconds)
    c = candidate_of(cfg)
    r = simulate_candidate(model_cost(cfg.model), w, hw, c, _plan_sync(cfg) if plan else None)
    return {**r, "hardware": hw.name, "configuration": str(c), "generated_tokens": w.generated_tokens,
            "prompt_tokens": w.prompt_tokens, "response_tokens": w.response_tokens}


def memory_by_role(cfg: RunConfig, hw: Hardware) -> dict:
    """The memory model's figures (GiB) on the busiest device of each role of `cfg` on `hw`, for `rlhf plan`:
    'state' (parameters, gradients, optimizer state; engine weights), 'total' adds activations, the logits chunk
    and ZeRO-3's gathered layer (trainer), the KV cache (rollout: `kv_cache`) and each process's runtime (the
    hardware file's runtime_gib)."""
    mc, w, c = model_cost(cfg.model), workload(cfg), candidate_of(cfg)
    rt = hw.runtime_gib
    t_rt, e_rt = rt.get("trainer", 0.0), rt.get("engine", 0.0)
    weights = engine_rank_weight_bytes(mc, c.engines, w.rollout_bytes, w.rollout_quant_bytes) / GIB
    engine = engine_memory(mc, w, hw, c.engines) / GIB
    roles = {"trainer": {"state": trainer_state_bytes(mc, c.trainer, w.train_bytes) / GIB,
                         "total": trainer_memory(mc, w, c.trainer) / GIB + t_rt},
             "rollout": {"state": weights, "kv_cache": engine - weights, "total": engine + e_rt}}
    if w.reference:
        ref = reference_memory(mc, w, c.trainer) / GIB
        roles["reference"] = {"state": ref, "total": ref + t_rt}
    return {"hardware": hw.name, "roles": roles}


def simulate_lines(cfg: RunConfig, result: dict) -> list[str]:
    step = result["step_seconds"]
    lines = [f"{cfg.model.name} on {result['hardware']}: {result['configuration']}",
             f"  workload: {cfg.data.gen_prompts_per_step or cfg.data.prompts_per_step} prompts x "
             f"{cfg.algorithm.group_size} samples, {result['prompt_tokens']:g} prompt + {result['response_tokens']:g} "
             f"generated tokens each",
             "  phase        seconds   share"]
    for k, v in result["phases"].items():
        if v:
            lines.append(f"  {k:<11} {v:9.3f}  {100 * v / step:5.1f} %" if step else f"  {k:<11} {v:9.3f}")
    hidden = sum(result["phases"].values()) - step
    if hidden > 1e-9:  # streamed scoring, StaleSync: phases that run beside others leave the step
        lines.append(f"  overlapped  {-hidden:9.3f}  {-100 * hidden / step:5.1f} %  (run beside other phases)")
    g = result["generation"]
    lines += [f"  step        {step:9.3f}  ({result['tokens_per_second']:.1f} generated tokens/s)",
              f"  generation: batch {g['batch']} per engine in {g['waves']} wave(s); the KV cache holds "
              f"{g['kv_seqs_max']} sequences per engine",
              "  memory (GiB, busiest device): " + ", ".join(f"{k} {v:.2f}" for k, v in
                                                            result["memory_gib_per_role"].items() if v)
              + f"; device {result['memory_gib_per_device']:.2f}" + ("" if result["fits"] else "  DOES NOT FIT")]
    return lines


def search_config(cfg: RunConfig, hw: Hardware, devices: int | None, top: int, prompt_tokens=None,
                  response_tokens=None, expert_load_skew: float = 1.0, max_staleness: int = 1,
                  reward_sample_seconds: float = 0.0) -> dict:
    n = devices or cfg.placement.nodes * cfg.placement.devices_per_node
    w = workload(cfg, prompt_tokens, response_tokens, expert_load_skew, reward_sample_seconds)
    return search(model_cost(cfg.model), cfg.model, w, hw, n, top, SearchSpace(max_staleness=max_staleness)) | {
        "devices": n}


def search_lines(found: dict) -> list[str]:
    ranked = found["ranked"]
    lines = [f"searched {found['devices']} devices: {found['layouts_evaluated']} layouts costed, "
             f"{found['configs_evaluated']} configurations scored ({found['configs_fitting']} fit) in "
             f"{found['seconds']:.2f} s"]
    if not ranked:
        return lines + ["  no configuration fits: more devices, a smaller batch or shorter sequences"]
    for i, r in enumerate(ranked):
        nxt = ranked[i + 1] if i + 1 < len(ranked) else None
        res = r.result
        lines += [f"#{i + 1} {res['tokens_per_second']:.1f} tokens/s, {res['step_seconds']:.3g} s/step, "
                  f"{res['memory_gib_per_device']:.1f} GiB/device: {r.candidate}",
                  f"    why: {why(r, nxt)}"]
    return lines


def write_config(cfg: RunConfig, c: Candidate, hw: Hardware, out: str | Path) -> tuple[Path, Path]:
    """`out`/run.yaml (the run's settings with the candidate's layouts) and `out`/placement.yaml."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    run = as_dict(cfg)
    placement = run.pop("placement")
    t = c.trainer
    run["trainer"].update(pp=t.pp, dp=t.dp, tp=t.tp, ep=t.ep, experts_over_tp_ep=t.experts_over_tp_ep,
                          zero_stage=t.zero_stage, micro_batch_tokens=t.micro_batch_tokens,
                          recompute=list(RECOMPUTE_ALL) if t.recompute else [], hierarchical_ep=t.hierarchical_ep)
    run["rollout"].update(tp=c.engines.tp, ep=c.engines.ep, num_engines=c.engines.engines,
                          quantization=c.quantization)
    run["stale_sync"]["max_staleness"] = c.staleness
    if (c.staleness or c.quantization != "none") and not run["algorithm"]["tis_cap"]:
        # off-policy samples, and samples of quantized engines, need the truncated importance weight
        run["algorithm"]["tis_cap"] = 2.0
    if c.colocated and not hw.shared_memory:  # the memory priced: the roles take turns, engines asleep
        run["rollout"]["sleep_level"] = run["rollout"]["sleep_level"] or 1
    if c.colocated and c.awake:  # priced overlapping the trainer on the shared cores: they must stay awake
        run["rollout"]["sleep_level"] = 0
    if c.colocated and c.staleness and run["rollout"]["sleep_level"]:
        run["stale_sync"]["partial_rollout"] = False  # turns: a sync never meets a generation
    n = c.devices
    per_node = hw.devices_per_node if n >= hw.devices_per_node else n
    nt = c.trainer_devices or t.world
    first = 0 if c.colocated else nt
    placement.update(nodes=math.ceil(n / per_node), devices_per_node=per_node, colocate=c.colocated)
    if not hw.shared_memory:
        placement["device_memory_gib"] = hw.memory_gib
    placement["trainer"] = {"devices": format_devices(range(nt))}
    placement["reference"] = {"devices": format_devices(range(nt))}
    placement["rollout"] = {"devices": format_devices(range(first, first + c.engines.world))}
    reward = placement.get("reward", {}).get("devices", "")
    if reward and any(int(x) >= n for x in reward.replace("-", ",").split(",") if x.strip().isdigit()):
        placement["reward"] = {"devices": str(n - 1)}
    run = {"defaults": {"placement": "placement.yaml"}} | run
    (out / "placement.yaml").write_text(yaml.safe_dump(placement, sort_keys=False))
    (out / "run.yaml").write_text(f"# Written by `rlhf simulate --search` on {hw.name}: {c}\n"
                                  + yaml.safe_dump(run, sort_keys=False))
    return out / "run.yaml", out / "placement.yaml"
