"""Expert-load balancing (EDPB) in the trainer on skewed routing: update seconds with and without it, side by side.

    python -m benchmarks.expert_balance_bench                 # EP 2 and EP 4 (dp = ep gloo processes)
    python -m benchmarks.expert_balance_bench --ep 2 --steps 6

The model is expert-heavy (hidden 256, 8 experts of 512 (`--experts 16`: 16), top-2, 2 MoE layers, random
weights written by our code) and its routers are skewed the way trained MoE routers are: a direction of the
router's input (the mean normed hidden state of a calibration batch) is added to the low-numbered experts'
router rows, more to lower ids, so most tokens pick a few experts, and under the contiguous expert map those
sit on EP rank 0. The boost is the smallest on a grid that puts 2x the mean tokens or more on the busiest EP
rank (EP 2: 1.9x; all tokens on one of two ranks is 2x).

For each EP degree two runs of the same trainer on the same batches: `unbalanced` keeps the contiguous map;
`balanced` trains one step, plans every layer from that step's loads (`rlhf.moe.balance.plan`) and
migrates the experts with their AdamW moments (`ParallelTrainer.migrate_experts`); then both time the same
`--steps` update steps (the slowest rank per step). The busiest EP rank's tokens over the mean is measured in
the timed steps under the map each run uses. Each rank's CPU seconds per step are measured too: where ranks
share cores (four on a 2-core machine) the wall-clock step is bounded by the total work over the cores, and
the busiest rank's CPU seconds (`cpu_speedup`) say what a step needs where each rank has a core of its own.
`exact`: the two runs' parameters after the last step, in logical (HF) order, are equal bit for bit. Ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

SAMPLES_PER_RANK, TOKENS = 16, 96


def model_config(experts: int = 8):
    from rlhf.schema import ModelConfig

    return ModelConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, num_experts=experts, num_experts_per_tok=2,
                       moe_intermediate_size=512, first_k_dense_layers=0, intermediate_size=512, rope_theta=10000.0)


def batch(ranks: int, seed: int = 0):
    import torch

    from rlhf.batch import TokenBatch

    g = torch.Generator().manual_seed(seed)
    B = SAMPLES_PER_RANK * ranks
    prompts = [[1] + torch.randint(3, 500, (7,), generator=g).tolist() for _ in range(B)]
    responses = [torch.randint(3, 500, (TOKENS,), generator=g).tolist() for _ in range(B)]
    return TokenBatch.from_samples(prompts, responses, [[-1.0] * TOKENS] * B).with_(
        advantages_B=torch.randn(B, generator=g))


def skewed_model(boost: float, experts: int = 8, seed: int = 0):
    """The model with each router's expert e row moved along its input's mean direction by boost * (1 - e / E)."""
    import torch

    from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM

    cfg = model_config(experts)
    model = Qwen3MoeForCausalLM(cfg)
    model.init_weights(seed, std=0.02)
    b = batch(1, seed=99)
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.gate.register_forward_pre_hook(
        lambda mod, args, i=i: inputs.__setitem__(i, args[0].reshape(-1, cfg.hidden_size).mean(0)))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(b.input_ids_BT, b.attention_mask_BT)
    for h in hooks:
        h.remove()
    E = cfg.num_experts
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            mu = inputs[i]
            for e in range(E):
                layer.mlp.gate.weight[e] += boost * (1 - e / E) * mu / mu.dot(mu)
    return model


def rank_load_ratio(loads, maps, ep: int) -> float:
    """The worst layer's tokens on the busiest EP rank over the mean."""
    from rlhf.moe.balance import rank_loads

    worst = 0.0
    for row, emap in zip(loads, maps):
        per = rank_loads(row, emap, ep)
        worst = max(worst, max(per) / (sum(per) / ep))
    return worst


def busiest_cpu_seconds(results: list[dict], steps: int) -> float:
    """Over the timed steps, the sum of each step's most CPU seconds on one rank (its process, all threads)."""
    return sum(max(r["cpu"][i] for r in results) for i in range(steps))


def worker(rank: int, model_dir: str, ep: int, balanced: bool, steps: int, experts: int) -> dict:
    import torch

    from rlhf.moe import balance as expert_balance
    from rlhf.algorithms.objective import LossRecord, loss_normaliser, policy_loss
    from rlhf.sharding.layout import Layout
    from rlhf.parallel.trainer import ParallelTrainer
    from rlhf.schema import AlgorithmConfig, TrainerConfig

    torch.set_num_threads(1)
    cfg = model_config(experts)
    layout = Layout(dp=ep, ep=ep)
    tr = ParallelTrainer(cfg, TrainerConfig(dp=ep, ep=ep, lr=1e-4, collective_timeout_s=600), layout, rank, model_dir)
    b = batch(ep)
    algo = AlgorithmConfig()
    normaliser = loss_normaliser(algo, b.mask_BT)
    mbs = b.micro_batches(list(range(len(b))), ep, layout.coords(rank).dp, 4096)

    def step():
        tr.train_step(mbs, lambda lp, e, mb: policy_loss(algo, lp, e, mb.extras, normaliser, LossRecord()))

    step()  # warm-up, and the loads the plan is made from
    out = {"migration": None}
    loads0 = tr.step_loads.double().tolist()
    out["ratio_contiguous"] = rank_load_ratio(loads0, tr.expert_maps, ep)
    if balanced:
        plan = expert_balance.plan(loads0, tr.expert_maps, ep)
        t0 = time.perf_counter()
        out["migration"] = tr.migrate_experts(plan.maps) | {"seconds": time.perf_counter() - t0,
                                                           "layers": sum(p.migrate for p in plan.layers)}
    seconds, cpu, ratios = [], [], []
    for _ in range(steps):
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        seconds.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        ratios.append(rank_load_ratio(tr.step_loads.double().tolist(), tr.expert_maps, ep))
    sharding, tensors = tr.export_shards()
    out |= {"seconds": seconds, "cpu": cpu, "ratio": sum(ratios) / len(ratios),
            "params": {(p.param, p.box.start): tensors[p.buffer][p.buffer_slices()].clone() for p in sharding.pieces}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.expert_balance_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4], choices=(2, 4))
    parser.add_argument("--steps", type=int, default=4, help="timed update steps per run")
    parser.add_argument("--experts", type=int, default=8, choices=(8, 16),
                        help="routed experts per MoE layer (16: four slots per rank at EP 4, so balancing can spread "
                             "the hot experts one per rank)")
    parser.add_argument("--target-ratio", type=float, default=2.0,
                        help="busiest EP rank over the mean under the contiguous map (at most 0.95 ep is asked)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: time at least one update step")

    import torch

    from rlhf.sharding.layout import default_expert_map
    from rlhf.model.hf_io import save_pretrained
    from rlhf.parallel.launch import run_ranks

    rows = []
    for ep in args.ep:
        # the smallest boost on the grid that skews the contiguous placement to the target
        target = min(args.target_ratio, 0.95 * ep)  # all tokens on one of ep ranks is ep
        for boost in (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0):
            model = skewed_model(boost, args.experts)
            b = batch(ep)
            with torch.no_grad():
                model(b.input_ids_BT, b.attention_mask_BT)
            loads = [layer.mlp.last_tokens_per_expert.double().tolist() for layer in model.model.layers]
            contiguous = [default_expert_map(args.experts, ep)] * len(loads)
            if rank_load_ratio(loads, contiguous, ep) >= target:
                break
        expert_ratio = max(max(row) / (sum(row) / len(row)) for row in loads)
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(model, d)
            runs = {}
            for name in ("unbalanced", "balanced", "unbalanced", "balanced"):  # interleaved: the machine drifts
                res = run_ranks(worker, ep, d, ep, name == "balanced", args.steps, args.experts, timeout_s=1200)
                per_step = [max(r["seconds"][i] for r in res) for i in range(args.steps)]
                runs.setdefault(name, []).append((sum(per_step), res))
        best = {k: min(v, key=lambda t: t[0]) for k, v in runs.items()}
        # the busiest rank's CPU seconds: what a step would take with a core per rank (less the waits)
        cpu = {k: min(busiest_cpu_seconds(res, args.steps) for _, res in v) for k, v in runs.items()}
        unb, bal = best["unbalanced"][1], best["balanced"][1]
        kept, moved = {}, {}
        for r in unb:
            kept |= r["params"]
        for r in bal:
            moved |= r["params"]
        exact = kept.keys() == moved.keys() and all(torch.equal(kept[k], moved[k]) for k in kept)
        mig = [r["migration"] for r in bal]
        row = {"ep": ep, "experts": args.experts, "boost": boost, "expert_max_over_mean": round(expert_ratio, 3),
               "update_seconds_unbalanced": round(best["unbalanced"][0], 3),
               "update_seconds_balanced": round(best["balanced"][0], 3),
               "update_seconds_unbalanced_all": [round(s, 3) for s, _ in runs["unbalanced"]],
               "update_seconds_balanced_all": [round(s, 3) for s, _ in runs["balanced"]],
               "speedup": round(best["unbalanced"][0] / best["balanced"][0], 3),
               "busiest_rank_cpu_seconds_unbalanced": round(cpu["unbalanced"], 3),
               "busiest_rank_cpu_seconds_balanced": round(cpu["balanced"], 3),
               "cpu_speedup": round(cpu["unbalanced"] / cpu["balanced"], 3),
               "load_max_over_mean_before": round(unb[0]["ratio"], 3),
               "load_max_over_mean_after": round(bal[0]["ratio"], 3),
               "layers_migrated": mig[0]["layers"], "experts_moved": mig[0]["experts_moved"],
               "migration_bytes": sum(m["bytes_sent"] for m in mig),
               "migration_seconds": round(max(m["seconds"] for m in mig), 3), "exact": exact}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    first = rows[0]
    print(json.dumps({"steps": args.steps, "experts": args.experts, "samples_per_rank": SAMPLES_PER_RANK,
                      "tokens": TOKENS + 8,
                      "update_seconds_balanced": first["update_seconds_balanced"],
                      "update_seconds_unbalanced": first["update_seconds_unbalanced"],
                      "load_max_over_mean_before": first["load_max_over_mean_before"],
                      "load_max_over_mean_after": first["load_max_over_mean_after"],
                      "exact": all(r["exact"] for r in rows), "runs": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
