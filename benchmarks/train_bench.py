"""Training-step throughput per layout against one process, and EP dispatch bytes across nodes.

    .venv/bin/python benchmarks/train_bench.py [--model configs/model/qwen3_moe_small.yaml] [--layers 2]
        [--batch 8] [--seq 128] [--steps 3] [--layouts single,tp2,dp2,...] [--device cuda]

Every layout runs in the same invocation, one after another, on the same random batch (tokens/s
counts real, unpadded tokens of forward + backward + optimizer step, after one warm-up step; the
largest rank's resident parameters + AdamW state are reported too, where zero_stage=3 shows). Each
rank gets 1 thread, so on this 2-core machine layouts of 4 ranks share 2 cores: the numbers show the
machinery's overhead here, not the speed-up of real devices. `--device cuda` (or npu) runs the ranks there,
on the device's backend (several ranks need as many devices; `--backend gloo` lets them share one). Prints
one JSON line per layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import torch

from rlhf.config import load_model_config
from rlhf.schema import TrainerConfig
from rlhf.model.hf_io import save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.parallel.launch import run_ranks
from rlhf.batch import MicroBatch
from rlhf.parallel.trainer import ParallelTrainer
from rlhf.sharding.layout import Layout

LAYOUTS = {
    "single": (Layout(), {}),
    "tp2": (Layout(tp=2), {}),
    "dp2": (Layout(dp=2), {}),
    "ep2": (Layout(dp=2, ep=2), {}),
    "pp2": (Layout(pp=2), {}),
    "ep4": (Layout(dp=4, ep=4), {}),
    "tp2xep2": (Layout(dp=2, tp=2, ep=2), {}),
    "dp2_zero3": (Layout(dp=2), {"zero_stage": 3}),
    "ep4_zero3": (Layout(dp=4, ep=4), {"zero_stage": 3}),
    "ep4_flat_2nodes": (Layout(dp=4, ep=4), {"ranks_per_node": 2}),
    "ep4_hier_2nodes": (Layout(dp=4, ep=4), {"ranks_per_node": 2, "hierarchical_ep": True}),
}


def batch(cfg, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    attn = (torch.arange(T)[None] < lens[:, None]).long()
    return ids * attn, attn


def loss_fn(logp, ent, mb):
    mask = mb.attention_mask_BT[:, 1:].float()
    return -(logp * mask).sum() / mb.extras["n"]


def worker(rank, cfg, layout, model_dir, kw, B, T, steps, micro, device="cpu"):
    kw = dict(kw)
    tr = ParallelTrainer(cfg, TrainerConfig(lr=1e-4, zero_stage=kw.pop("zero_stage", 1)), layout, rank, model_dir,
                         device=device, **kw)
    sync = getattr(torch, device).synchronize if device != "cpu" else (lambda: None)  # time the device's work
    ids, attn = batch(cfg, B, T)
    rows = list(range(layout.coords(rank).dp, B, layout.dp))
    n = float(attn[:, 1:].sum())
    mbs = [MicroBatch(ids[rows[i:i + micro]], attn[rows[i:i + micro]], {"n": n}) for i in range(0, len(rows), micro)]
    tr.train_step(mbs, loss_fn)  # warm-up
    sync()
    torch.distributed.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.train_step(mbs, loss_fn)
    sync()
    torch.distributed.barrier()
    return {"seconds": (time.perf_counter() - t0) / steps, "dispatch": dataclasses.asdict(tr.dispatcher.stats),
            "state_bytes": sum(p.numel() * p.element_size() for p in tr.params.values()) + tr.optimizer.state_bytes()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="configs/model/qwen3_moe_small.yaml")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    ap.add_argument("--backend", default="auto", help="the ranks' collective backend (auto: by device)")
    args = ap.parse_args()
    if args.device != "cpu" and not (getattr(torch, args.device, None) and getattr(torch, args.device).is_available()):
        ap.error(f"--device {args.device}: no such device in this process (torch.{args.device}.is_available() is false)")
    cfg = dataclasses.replace(load_model_config(args.model, [f"num_hidden_layers={args.layers}"]))
    ids, attn = batch(cfg, args.batch, args.seq)
    tokens = int(attn.sum())
    with tempfile.TemporaryDirectory() as d:
        m = Qwen3MoeForCausalLM(cfg)
        m.init_weights(0)
        save_pretrained(m, d)
        del m
        base = None
        for name in args.layouts.split(","):
            layout, kw = LAYOUTS[name]
            res = run_ranks(worker, layout.world_size, cfg, layout, d, kw, args.batch, args.seq, args.steps,
                            args.micro, args.device, timeout_s=1800, device_type=args.device, backend=args.backend)
            sec = max(r["seconds"] for r in res)
            tps = tokens / sec
            base = base or tps
            out = {"layout": name, "device": args.device, "ranks": layout.world_size, "tokens_per_s": round(tps, 1),
                   "vs_single": round(tps / base, 3), "step_s": round(sec, 3),
                   "params_and_adamw_MB_per_rank": round(max(r["state_bytes"] for r in res) / 2**20, 1)}
            if layout.expert_shards > 1:
                out["ep_forward_inter_node_bytes"] = sum(r["dispatch"]["forward_inter_node"] for r in res)
                out["ep_total_inter_node_bytes"] = sum(r["dispatch"]["forward_inter_node"] +
                                                       r["dispatch"]["backward_inter_node"] for r in res)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
