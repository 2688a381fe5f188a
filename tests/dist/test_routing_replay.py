"""Routing replay in the parallel trainer equals one process with replay: R3 (the engine's routes forced in
every forward) and R2 (the old-logprob forward's own routes forced in every update), over TP, EP, PP, DP and
recomputation; the per-token count of layers whose live choice differs from the engine's is the same too."""

import pytest
import torch

from rlhf.batch import MicroBatch
from rlhf.sharding.layout import Layout
from rlhf.model.hf_io import load_pretrained, save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.moe.routing import Routing
from rlhf.parallel.launch import run_ranks
from rlhf.parallel.trainer import ParallelTrainer, token_logprobs
from rlhf.schema import RoutingReplay, TrainerConfig
from tests.dist.test_trainer import B, CFG, MB, STEPS, TCFG, T, TOL, loss_fn, make_batch

L, K = CFG.num_hidden_layers - CFG.first_k_dense_layers, CFG.num_experts_per_tok


def engine_routes():
    """Routes an 'engine' chose: another model's live top-k on the same tokens (most sets differ), none on
    padding or on each sequence's last token."""
    other = Qwen3MoeForCausalLM(CFG)
    other.init_weights(seed=5, std=0.2)
    ids, attn, _ = make_batch()
    r = Routing(record=True)
    with torch.no_grad():
        other(ids, attn, routing=r)
    routes = r.chosen_BTLk(B, T, L, K)
    lens = attn.sum(1)
    routes[torch.arange(T)[None] >= (lens - 1)[:, None]] = -1
    return routes


def micro_batches(rows, routes):
    ids, attn, adv = make_batch()
    n = float(attn[:, 1:].sum())
    rows = list(rows)
    return [MicroBatch(ids[r], attn[r], {"adv": adv[r], "n_tokens": n, "rows": torch.tensor(r)}, routes[r])
            for r in (rows[i:i + MB] for i in range(0, len(rows), MB))]


def reference(model_dir, mode: RoutingReplay, routes):
    """One process, no trainer: the plain model with the routes forced by hand."""
    model = load_pretrained(model_dir)
    mbs = micro_batches(range(B), routes)
    rollout = mode is RoutingReplay.rollout
    # the step's first forward: the engine's routes forced (R3) or the live choice recorded (R2)
    first = [Routing(m.routes_BTLk if rollout else None, m.routes_BTLk, record=not rollout) for m in mbs]
    with torch.no_grad():
        logp = torch.cat([token_logprobs(model(m.input_ids_BT, m.attention_mask_BT, routing=r), m.input_ids_BT)[0]
                          for m, r in zip(mbs, first)])
    forced = []
    for m, r in zip(mbs, first):
        f = m.routes_BTLk if rollout else r.chosen_BTLk(*m.input_ids_BT.shape, L, K)
        f[m.attention_mask_BT == 0] = -1
        forced.append(f)
    opt = torch.optim.AdamW(model.parameters(), lr=TCFG.lr, betas=TCFG.betas, eps=TCFG.adam_eps,
                            weight_decay=TCFG.weight_decay)
    out = {"logp": logp, "differs": torch.cat([r.differ_count_BT(*m.input_ids_BT.shape) for m, r in zip(mbs, first)])}
    for step in range(STEPS):
        opt.zero_grad()
        for m, f in zip(mbs, forced):
            lp, ent = token_logprobs(model(m.input_ids_BT, m.attention_mask_BT, routing=Routing(forced_BTLk=f)),
                                     m.input_ids_BT)
            loss_fn(lp, ent, m).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TCFG.grad_clip)
        if step == 0:
            out["grads"] = dict(to_hf_tensors({n: p.grad.clone() for n, p in model.named_parameters()}, CFG))
            out["norm"] = float(norm)
        opt.step()
    out["params"] = dict(to_hf_tensors({n: p.detach().clone() for n, p in model.state_dict().items()}, CFG))
    return out


def worker(rank, layout, model_dir, kw):
    routes = kw.pop("routes", None)
    tcfg = TrainerConfig(**(TCFG.__dict__ | {"routing_replay": kw.pop("mode")} | kw.pop("tcfg", {})))
    tr = ParallelTrainer(CFG, tcfg, layout, rank, model_dir, **kw)
    rows = list(range(layout.coords(rank).dp, B, layout.dp))
    mbs = micro_batches(rows, engine_routes() if routes is None else routes)
    res = {"logp": tr.logprobs(mbs), "rows": rows, "differs": tr.route_differs}
    for step in range(STEPS):
        stats = tr.train_step(mbs, loss_fn)
        if step == 0:
            res["norm"] = stats["grad_norm"]
            res["grads"] = {n: p.grad.clone() for n, p in tr.params.items()}
    res["sharding"], tensors = tr.export_shards()
    res["params"] = {n: t.clone() for n, t in tensors.items()}
    return res


LAYOUTS = {
    "tp2xep2": (Layout(dp=2, tp=2, ep=2), {}),
    "pp2xdp2": (Layout(pp=2, dp=2), {}),
    "ep2_recompute": (Layout(dp=2, ep=2), {"tcfg": {"recompute": ("attention", "experts", "norms")}}),
    "pp2xtp2": (Layout(pp=2, tp=2), {}),
    "ep4_hierarchical": (Layout(dp=4, ep=4), {"ranks_per_node": 2, "hierarchical_ep": True}),
}
CASES = [("rollout", "tp2xep2"), ("rollout", "pp2xdp2"), ("rollout", "ep2_recompute"), ("rollout", "ep4_hierarchical"),
         ("old", "pp2xtp2"), ("old", "tp2xep2")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("replay_model")
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=11, std=0.2)
    save_pretrained(m, d)
    return d


@pytest.fixture(scope="module")
def refs(model_dir):
    routes = engine_routes()
    return {mode: reference(model_dir, RoutingReplay(mode), routes) for mode in ("rollout", "old")}


@pytest.mark.parametrize("mode,name", CASES)
def test_replay_in_layout_equals_single_process(mode, name, model_dir, refs):
    layout, kw = LAYOUTS[name]
    ref = refs[mode]
    results = run_ranks(worker, layout.world_size, layout, str(model_dir), dict(kw) | {"mode": RoutingReplay(mode)},
                        timeout_s=240)
    assert ref["differs"].sum() > B * T // 2  # the engine's routes differ on most tokens: forcing them matters
    for rank, res in enumerate(results):
        assert abs(res["norm"] - ref["norm"]) <= TOL * max(1.0, ref["norm"]), (rank, res["norm"], ref["norm"])
        if res["logp"] is not None:
            got = torch.cat([lp for lp, _ in res["logp"]])
            assert (got - ref["logp"][res["rows"]]).abs().max() <= TOL, rank
            for rows, d in res["differs"]:  # every stage's layers counted on the rank that returns rows
                assert torch.equal(d, ref["differs"][rows][:, :d.shape[1]]), rank
        for what in ("grads", "params"):
            for p in res["sharding"].pieces:
                got = res[what][p.buffer][p.buffer_slices()]
                assert (got - ref[what][p.param][p.box.slices()]).abs().max() <= TOL, (rank, what, p.param)


def test_an_expert_rank_that_receives_no_rows_still_joins_every_collective(model_dir):
    """Every token routed to experts 4 and 5, both on EP rank 1 (ep2: rank 0 holds experts 0-3): rank 0's
    experts get no row in any layer or micro-batch, forward or backward; the result equals one process. (The
    update of a random DeepSeek-V3 policy, whose group-limited router can send one EP rank nothing, hung
    until the empty expert output stayed tied to its input; tests/e2e/test_rl_run.py runs that case.)"""
    ids, attn, _ = make_batch()
    routes = torch.tensor([4, 5], dtype=torch.int16).expand(B, T, L, K).clone()
    routes[torch.arange(T)[None] >= (attn.sum(1) - 1)[:, None]] = -1
    ref = reference(model_dir, RoutingReplay.rollout, routes)
    layout = Layout(dp=2, ep=2)
    results = run_ranks(worker, layout.world_size, layout, str(model_dir),
                        {"mode": RoutingReplay.rollout, "routes": routes}, timeout_s=240)
    for rank, res in enumerate(results):
        assert abs(res["norm"] - ref["norm"]) <= TOL * max(1.0, ref["norm"]), rank
        assert (torch.cat([lp for lp, _ in res["logp"]]) - ref["logp"][res["rows"]]).abs().max() <= TOL, rank
        for p in res["sharding"].pieces:
            got = res["params"][p.buffer][p.buffer_slices()]
            assert (got - ref["params"][p.param][p.box.slices()]).abs().max() <= TOL, (rank, p.param)
