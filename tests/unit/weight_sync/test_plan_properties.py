"""Property tests over random small trainer and engine layouts: TP, EP with shuffled expert maps, PP,
DP replicas, redundant experts (EPLB maps), several engines, fused buffers, attention-DP engines,
co-located or not, GQA and MLA shapes, engines with or without the MTP module. A random model sliced into the trainer's buffers and
copied by the plan lands in every engine buffer bit for bit as the global tensors sliced by the engine
spec, padding untouched; the byte counts add up; replicas are chosen local first, then same node."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_configs import gqa, mla

from rlhf.model.shapes import param_shapes
from rlhf.sharding.trainer import rank_sharding
from weight_sync.pieces import local_tensors
from weight_sync.apply_local import apply_local
from rlhf.sharding.engine import engine_shard_spec
from rlhf.sharding.layout import InferenceLayout, Layout, default_expert_map
from weight_sync.plan import Topology, plan_reshard
from weight_sync.spec import ShardSpec
from rlhf.sharding.trainer import trainer_shard_spec

SENTINEL = 12345.0  # engine buffers start filled with it; padding rows must keep it


@st.composite
def cases(draw):
    layers = draw(st.integers(1, 3))
    experts = draw(st.sampled_from([4, 8]))
    dense = draw(st.integers(0, min(1, layers - 1)))
    vocab = draw(st.integers(5, 70))
    if draw(st.booleans()):
        cfg = gqa(layers, draw(st.sampled_from([1, 2, 4])), experts, dense, vocab)
    else:
        cfg = mla(layers, draw(st.sampled_from([0, 4])), experts, dense, vocab)
    # trainer: ep carved out of dp x tp, experts split over ep (x tp)
    tp, dp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 2)), draw(st.integers(1, layers))
    over = draw(st.booleans())
    eps = [e for e in (1, 2, 4) if (dp * tp) % (e * tp if over else e) == 0 and experts % (e * tp if over else e) == 0]
    src_layout = Layout(pp=pp, dp=dp, tp=tp, ep=draw(st.sampled_from(eps)), experts_over_tp_ep=over)
    src_map = draw(st.permutations(default_expert_map(experts, src_layout.expert_shards)))
    # engines: tp, ep in {1} or multiples of tp dividing the experts
    dtp = draw(st.sampled_from([1, 2, 4]))
    dep = draw(st.sampled_from([1] + [e for e in (dtp, 2 * dtp) if e > 1 and experts % e == 0]))
    # redundant experts (vLLM EPLB): extra physical slots, a shuffled physical -> logical map or vLLM's default
    redundant = draw(st.sampled_from([r for r in range(2 * dep + 1) if (experts + r) % dep == 0])) if dep > 1 else 0
    dst_layout = InferenceLayout(tp=dtp, ep=dep, engines=draw(st.integers(1, 2)), redundant_experts=redundant)
    dst_map = {}
    if redundant:
        extra = draw(st.lists(st.integers(0, experts - 1), min_size=redundant, max_size=redundant))
        if draw(st.booleans()):
            dst_map = {"physical_experts": draw(st.permutations(list(range(experts)) + extra))}
    elif dep > 1:
        dst_map = {"expert_map": draw(st.permutations(default_expert_map(experts, dep)))}
    offset = draw(st.sampled_from([0, src_layout.world_size, src_layout.world_size // 2]))
    world = max(src_layout.world_size, offset + dst_layout.world_size)
    nodes = tuple(draw(st.lists(st.integers(0, 2), min_size=world, max_size=world)))
    topology = Topology("random", nodes, 1e9)
    return cfg, src_layout, tuple(src_map), dst_layout, dst_map, draw(st.booleans()), offset, topology


def source_buffers(cfg, layout, emap, src: ShardSpec, full):
    """Trainer buffers, sliced by the trainer's own `local_tensors` (what the parallel trainer loads)."""
    return {r: local_tensors(full, rank_sharding(cfg, layout, r, emap)) for r in range(layout.world_size)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**31 - 1))
def test_plan_copies_every_engine_buffer_exactly(case, seed):
    cfg, src_layout, src_map, dst_layout, dst_map, mtp, offset, topology = case
    src = trainer_shard_spec(cfg, src_layout, expert_map=src_map)
    dst = engine_shard_spec(cfg, dst_layout, rank_offset=offset, include_mtp=mtp, **dst_map)
    plan = plan_reshard(src, dst, topology)

    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(s, generator=g) for n, s in param_shapes(cfg).items()}
    src_bufs = source_buffers(cfg, src_layout, src_map, src, full)
    dst_bufs = {r.rank: {n: torch.full(s, SENTINEL) for n, s in r.buffers} for r in dst.ranks}
    assert apply_local(plan, src_bufs, dst_bufs) * 4 == plan.bytes_minimal

    for r in dst.ranks:
        covered = {n: torch.zeros(s, dtype=torch.bool) for n, s in r.buffers}
        for p in r.pieces:
            got = dst_bufs[r.rank][p.buffer][p.buffer_slices()]
            want = full[p.param][p.box.slices()]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (r.rank, p.param, p.box)
            covered[p.buffer][p.buffer_slices()] = True
        for n, mask in covered.items():  # padding rows (vocabulary) keep their contents
            assert bool((dst_bufs[r.rank][n][~mask] == SENTINEL).all()), (r.rank, n)

    assert plan.bytes_network + plan.bytes_local == plan.bytes_minimal
    assert plan.bytes_minimal == 4 * sum(p.box.numel for r in dst.ranks for p in r.pieces)
    assert sum(b for _, b in plan.send_bytes) == sum(b for _, b in plan.recv_bytes) == plan.bytes_network

    holders = {}  # (param, box) -> ranks holding exactly that source box
    for r in src.ranks:
        for p in r.pieces:
            holders.setdefault((p.param, p.box), set()).add(r.rank)
    for t in plan.transfers():
        assert t.local == (t.src == t.dst)
        ranks = {s for (param, box), rs in holders.items() if param == t.param and box.intersect(t.box) == t.box
                 for s in rs}
        assert t.src in ranks
        if t.dst in ranks:
            assert t.local, f"{t.param} {t.box}: rank {t.dst} holds it but the plan sends it from {t.src}"
        elif any(topology.nodes[s] == topology.nodes[t.dst] for s in ranks):
            assert topology.nodes[t.src] == topology.nodes[t.dst], f"{t.param}: a same-node replica was skipped"
