"""Random layout pairs resharded over 4 real gloo processes: `run_plan` (buckets, transfers moved in place,
shared memory for random rank pairs, fp32 and bf16, fp32 sources cast on the way) leaves every engine
buffer equal to the global tensors sliced by the engine spec, bit for bit, with padding untouched, and
the byte counts add up.

The pairs are drawn from a seeded generator in this process (GQA and MLA models, TP, PP, DP, EP with
shuffled expert maps, ZeRO-3 row shards, attention-DP engines with redundant experts, several engines,
co-located or not); one set of 4 processes runs them all, each rank building the same seeded model and
holding only its own buffers."""

import os
import random

import torch
from tiny_configs import gqa, mla

from rlhf.model.shapes import param_shapes
from rlhf.sharding.trainer import rank_sharding, trainer_shard_spec
from weight_sync.pieces import local_tensors
from rlhf.parallel.launch import run_ranks
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout, default_expert_map
from weight_sync.p2p import run_plan
from weight_sync.plan import Topology, plan_reshard

WORLD = 4
SENTINEL = 12345.0  # engine buffers start filled with it; padding rows must keep it


def draw_pair(rng: random.Random) -> dict:
    """One random layout pair within WORLD ranks (the in-process property test's space, narrowed to 4 ranks)."""
    layers = rng.randint(1, 2)
    experts = rng.choice([4, 8])
    dense = rng.randint(0, layers - 1)
    vocab = rng.randint(5, 70)
    if rng.random() < 0.5:
        cfg = gqa(layers, rng.choice([1, 2, 4]), experts, dense, vocab)
    else:
        cfg = mla(layers, rng.choice([0, 4]), experts, dense, vocab)
    tp = rng.choice([1, 2, 4])
    dp = rng.choice([d for d in (1, 2, 4) if tp * d <= WORLD])
    pp = rng.choice([p for p in range(1, layers + 1) if tp * dp * p <= WORLD])
    over = rng.random() < 0.5
    eps = [e for e in (1, 2, 4) if (dp * tp) % (e * tp if over else e) == 0 and experts % (e * tp if over else e) == 0]
    src_layout = Layout(pp=pp, dp=dp, tp=tp, ep=rng.choice(eps), experts_over_tp_ep=over)
    src_map = list(default_expert_map(experts, src_layout.expert_shards))
    rng.shuffle(src_map)
    dtp = rng.choice([1, 2, 4])
    dep = rng.choice([1] + [e for e in (dtp, 2 * dtp) if 1 < e <= WORLD and experts % e == 0])
    redundant = rng.choice([r for r in range(2 * dep + 1) if (experts + r) % dep == 0]) if dep > 1 else 0
    dst_layout = InferenceLayout(tp=dtp, ep=dep, engines=rng.randint(1, WORLD // (dep if dep > 1 else dtp)),
                                 redundant_experts=redundant)
    dst_map = {}
    if redundant:  # vLLM EPLB's physical -> logical map, shuffled
        slots = list(range(experts)) + [rng.randrange(experts) for _ in range(redundant)]
        rng.shuffle(slots)
        dst_map = {"physical_experts": tuple(slots)}
    elif dep > 1:
        emap = list(default_expert_map(experts, dep))
        rng.shuffle(emap)
        dst_map = {"expert_map": tuple(emap)}
    offset = rng.randint(0, WORLD - dst_layout.world_size)
    world = max(src_layout.world_size, offset + dst_layout.world_size)
    rank_pairs = [(a, b) for a in range(world) for b in range(a + 1, world)]
    return {"cfg": cfg, "src": src_layout, "src_map": tuple(src_map), "zero": rng.choice([1, 3]),
            "dst": dst_layout, "dst_map": dst_map, "mtp": rng.random() < 0.5, "offset": offset,
            "topology": Topology("random", tuple(rng.randint(0, 1) for _ in range(world)), 1e9),
            "same_device": sorted(set(rng.sample(rank_pairs, min(len(rank_pairs), rng.randint(0, 2))))),
            "dtype": rng.choice(["float32", "bfloat16"]), "fp32_source": rng.random() < 0.3,
            "bucket_bytes": rng.choice([64, 4096, 1 << 20]),
            "alone_bytes": rng.choice([0, 256, 2048, 1 << 40]), "seed": rng.randrange(2**31)}


def worker(rank, cases):
    out = []
    for c in cases:
        cfg, dtype = c["cfg"], getattr(torch, c["dtype"])
        src_spec = trainer_shard_spec(cfg, c["src"], c["src_map"], zero_stage=c["zero"])
        dst_spec = engine_shard_spec(cfg, c["dst"], rank_offset=c["offset"], **c["dst_map"],
                                     include_mtp=c["mtp"])
        plan = plan_reshard(src_spec, dst_spec, c["topology"], dtype_bytes=dtype.itemsize)
        g = torch.Generator().manual_seed(c["seed"])
        full = {n: torch.randn(s, generator=g).to(dtype) for n, s in param_shapes(cfg).items()}
        src = (local_tensors(full, rank_sharding(cfg, c["src"], rank, c["src_map"], zero_stage=c["zero"]))
               if rank < c["src"].world_size else None)
        if src and c["fp32_source"]:  # an fp32 master copy: cast to the engines' dtype as it is packed
            src = {n: t.float() for n, t in src.items()}
        mine = next((r for r in dst_spec.ranks if r.rank == rank), None)
        dst = {n: torch.full(s, SENTINEL, dtype=dtype) for n, s in mine.buffers} if mine else None
        stats = run_plan(plan, rank, src, dst, dtype, bucket_bytes=c["bucket_bytes"], alone_bytes=c["alone_bytes"],
                         same_device=c["same_device"])
        wrong = []
        if mine:
            covered = {n: torch.zeros(s, dtype=torch.bool) for n, s in mine.buffers}
            for p in mine.pieces:
                got, want = dst[p.buffer][p.buffer_slices()], full[p.param][p.box.slices()]
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    wrong.append(f"{p.param} {p.box}")
                covered[p.buffer][p.buffer_slices()] = True
            wrong += [f"padding of {n}" for n, m in covered.items() if not bool((dst[n][~m] == SENTINEL).all())]
        out.append({"wrong": wrong, "received": stats.bytes_received + stats.bytes_shm, "local": stats.bytes_local,
                    "checked": stats.checked_transfers, "plan": (plan.bytes_minimal, plan.bytes_network)})
    return out


def test_random_layout_pairs_are_exact_over_gloo():
    seed = int(os.environ.get("WEIGHT_SYNC_RANDOM_SEED", "0"))  # CI: fixed; set it to explore other pairs
    rng = random.Random(seed)
    cases = [draw_pair(rng) for _ in range(24)]
    results = run_ranks(worker, WORLD, cases, timeout_s=300)
    for i, c in enumerate(cases):
        per_rank = [r[i] for r in results]
        name = (f"seed {seed} case {i}: {c['src']} zero{c['zero']} -> {c['dst']} at {c['offset']}, {c['dtype']}, "
                f"shm {c['same_device']}")
        assert all(not r["wrong"] for r in per_rank), (name, [r["wrong"][:3] for r in per_rank])
        minimal, network = per_rank[0]["plan"]
        assert sum(r["received"] for r in per_rank) == network, name
        assert sum(r["received"] + r["local"] for r in per_rank) == minimal, name
        network_transfers = sum(len(ts) for (s, d), ts in plan_pairs(c) if s != d)
        assert sum(r["checked"] for r in per_rank) == network_transfers, name  # every transfer checksummed


def plan_pairs(c):
    src = trainer_shard_spec(c["cfg"], c["src"], c["src_map"], zero_stage=c["zero"])
    dst = engine_shard_spec(c["cfg"], c["dst"], rank_offset=c["offset"], **c["dst_map"], include_mtp=c["mtp"])
    return plan_reshard(src, dst, c["topology"], dtype_bytes=getattr(torch, c["dtype"]).itemsize).pairs
