"""The parallel trainer equals one process: logprobs, gradients, 3 AdamW steps (fp32, <= 1e-5),
offload/onload bit-exact, recomputation, shard export. At most 4 gloo processes per test."""

import pytest
import torch

from rlhf.schema import Architecture, Attention, DType, MLAConfig, ModelConfig, RouterScoring, TrainerConfig
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM, router_bias_update
from rlhf.parallel.launch import run_ranks
from rlhf.parallel.comm import flat_view
from rlhf.parallel.optim import _views_of
from rlhf.batch import MicroBatch
from rlhf.parallel.trainer import ParallelTrainer, token_logprobs
from rlhf.sharding.layout import Layout

CFG = ModelConfig(vocab_size=40, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  first_k_dense_layers=1, intermediate_size=48, rope_theta=10000.0)
# The DeepSeek-V3 / Pangu architecture: MLA with q LoRA, a dense-first layer, sigmoid group-limited routing with
# a (frozen, nonzero) correction bias, a shared expert, an MTP module (frozen, carried on the last stage).
PANGU = ModelConfig(vocab_size=40, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=16, architecture=Architecture.pangu_moe, attention=Attention.mla,
                    mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8),
                    router_scoring=RouterScoring.sigmoid, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
                    shared_expert_intermediate_size=32, first_k_dense_layers=1, intermediate_size=48,
                    num_mtp_layers=1, rope_theta=10000.0)
# Adam's update g / (sqrt(v) + eps) turns fp32 rounding noise (~1e-9) in near-zero gradients into parameter
# differences of up to lr * noise / eps; eps 1e-6 keeps that below 1e-8 so the 1e-5 check sees real errors only.
TCFG = TrainerConfig(lr=1e-3, adam_eps=1e-6, grad_clip=0.5, collective_timeout_s=60)
B, T, MB, STEPS, TOL = 8, 12, 2, 3, 1e-5
RTOL_BF16 = 1e-2  # bf16 keeps 8 bits: 2^-8 = 3.9e-3 of a value per rounding


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, CFG.vocab_size, (B, T), generator=g)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    attn = (torch.arange(T)[None] < lens[:, None]).long()
    ids = ids * attn
    adv = torch.randn(B, generator=g)
    return ids, attn, adv


def loss_fn(logp, ent, mb):
    mask = mb.attention_mask_BT[:, 1:].float()
    n = mb.extras["n_tokens"]
    return (-(mb.extras["adv"][:, None] * logp * mask).sum() - 0.01 * (ent * mask).sum()) / n


def micro_batches(ids, attn, adv, rows):
    n = float(attn[:, 1:].sum())
    rows = list(rows)
    return [MicroBatch(ids[rows[i:i + MB]], attn[rows[i:i + MB]], {"adv": adv[rows[i:i + MB]], "n_tokens": n})
            for i in range(0, len(rows), MB)]


def reference(model_dir, router_bias_update_rate=0.0, compute=None):
    """One process, torch's AdamW; `compute`: the forwards under autocast to that dtype (trainer.compute_dtype)."""
    import contextlib

    from rlhf.model.hf_io import load_pretrained

    def autocast():
        return torch.autocast("cpu", dtype=compute) if compute is not None else contextlib.nullcontext()

    model = load_pretrained(model_dir)
    ids, attn, adv = make_batch()
    mbs = micro_batches(ids, attn, adv, range(B))
    with torch.no_grad(), autocast():
        logp = torch.cat([token_logprobs(model(m.input_ids_BT, m.attention_mask_BT), m.input_ids_BT)[0] for m in mbs])
    opt = torch.optim.AdamW(model.parameters(), lr=TCFG.lr, betas=TCFG.betas, eps=TCFG.adam_eps,
                            weight_decay=TCFG.weight_decay)
    out = {"logp": logp}
    blocks = [layer.mlp for layer in model.model.layers[:model.config.num_hidden_layers] if layer.is_moe]
    for step in range(STEPS):
        opt.zero_grad()
        for block in blocks:
            block.step_tokens_per_expert = None
        for m in mbs:
            with autocast():
                lp, ent = token_logprobs(model(m.input_ids_BT, m.attention_mask_BT), m.input_ids_BT)
            loss_fn(lp, ent, m).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), TCFG.grad_clip)
        if step == 0:
            out["grads"] = dict(to_hf_tensors({n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}, model.config))
            out["norm"] = float(norm)
        opt.step()
        out["loads"] = torch.stack([b.step_tokens_per_expert for b in blocks])
        with torch.no_grad():
            for b in blocks:
                if router_bias_update_rate:
                    bias = b.gate.e_score_correction_bias
                    bias.copy_(router_bias_update(bias, b.step_tokens_per_expert, router_bias_update_rate))
    out["params"] = dict(to_hf_tensors({n: p.detach().clone() for n, p in model.state_dict().items()}, model.config))
    return out


def worker(rank, layout, model_dir, kw):
    tcfg = TrainerConfig(**(TCFG.__dict__ | kw.pop("tcfg", {})))
    tr = ParallelTrainer(kw.pop("cfg", CFG), tcfg, layout, rank, model_dir, **kw)
    c = layout.coords(rank)
    ids, attn, adv = make_batch()
    mbs = micro_batches(ids, attn, adv, range(c.dp, B, layout.dp))
    res = {"logp": tr.logprobs(mbs), "rows": list(range(c.dp, B, layout.dp))}
    for step in range(STEPS):
        stats = tr.train_step(mbs, loss_fn)
        if step == 0:
            res["norm"] = stats["grad_norm"]
            res["grads"] = {n: p.grad.clone() for n, p in tr.trained.items()}
            # cpu: each optimizer bucket's gradient slice is a view of the gradient buffer, not a copy
            res["grad_views"] = [flat_view([p.grad for p in b.params], b.lo, b.hi) is not None
                                 for b in tr.optimizer.buckets]
    res["loads"] = tr.router_stats().clone()
    res["moe_layers"] = [i - tr.cfg.first_k_dense_layers for i in tr.stages[tr.stage] if i >= tr.cfg.first_k_dense_layers]
    before = {n: p.detach().clone() for n, p in tr.params.items()}
    state_before = [t.clone() for t in tr.optimizer.owned_tensors()]
    freed = tr.offload()
    res["empty_after_offload"] = all(t.numel() == 0 for t in list(tr.params.values()) + tr.optimizer.owned_tensors())
    # gradients are not kept: on cpu their pages went back and read as zeros, what the next step starts from
    res["grads_after_offload"] = [None if p.grad is None else bool(p.grad.any()) for p in tr.trained.values()]
    restored = tr.onload()
    res["offload_bytes"] = (freed, restored)
    # a bucket this rank steps alone: its parameters are views of the optimizer's master, through steps and offload
    res["master_views"] = [_views_of(b.params, b.master) for b in tr.optimizer.buckets if b.size == 1]
    res["offload_exact"] = all(torch.equal(before[n], p) for n, p in tr.params.items()) and all(
        torch.equal(a, b) for a, b in zip(state_before, tr.optimizer.owned_tensors()))
    res["optimizer_state_bytes"] = tr.optimizer.state_bytes()
    res["param_bytes"] = sum(p.numel() * p.element_size() for p in tr.params.values())
    sharding, tensors = tr.export_shards()
    res["sharding"], res["params"] = sharding, {n: t.clone() for n, t in tensors.items()}
    res["dispatch"] = tr.dispatcher.stats
    return res


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_model")
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=11, std=0.2)
    save_pretrained(m, d)
    return d


@pytest.fixture(scope="module")
def ref(model_dir):
    return reference(model_dir)


def check_against_reference(results, layout, ref, tol=TOL, rtol=0.0):
    """Within `tol`, plus `rtol` times the largest magnitude of each compared tensor."""
    for rank, res in enumerate(results):
        assert abs(res["norm"] - ref["norm"]) <= (tol + rtol) * max(1.0, ref["norm"]), (rank, res["norm"], ref["norm"])
        if res["logp"] is not None:
            got = torch.cat([lp for lp, _ in res["logp"]])
            assert (got - ref["logp"][res["rows"]]).abs().max() <= tol, rank
        sharding = res["sharding"]
        for what in ("grads", "params"):
            for p in sharding.pieces:
                if p.buffer not in res[what]:  # frozen: no gradient (its value is checked under params)
                    assert what == "grads" and p.param not in ref["grads"], (rank, p.param)
                    continue
                got = res[what][p.buffer][p.buffer_slices()]
                want = ref[what][p.param][p.box.slices()]
                err = (got - want).abs().max().item()
                assert err <= tol + rtol * want.abs().max().item(), (rank, what, p.param, err)
        assert res["offload_exact"] and res["empty_after_offload"]
        assert res["grads_after_offload"] and not any(res["grads_after_offload"])
        assert res["grad_views"] and all(res["grad_views"])
        assert all(res["master_views"])
        assert None not in res["grads_after_offload"]  # cpu: still the same (released) views
        assert res["offload_bytes"][0] == res["offload_bytes"][1] > 0
    # the exported shards, put back together by their own spec, give the full state dict exactly
    full = {n: torch.full_like(t, float("nan")) for n, t in ref["params"].items()}
    for res in results:
        for p in res["sharding"].pieces:
            full[p.param][p.box.slices()] = res["params"][p.buffer][p.buffer_slices()]
    for n, t in full.items():
        assert not t.isnan().any(), f"{n} not covered by the export"


LAYOUTS = {
    "tp2": (Layout(tp=2), {}),
    "dp2": (Layout(dp=2), {}),
    "ep2": (Layout(dp=2, ep=2), {}),
    "ep4": (Layout(dp=4, ep=4), {}),
    "pp2": (Layout(pp=2), {"stage_split": [1, 3]}),
    "tp2xep2": (Layout(dp=2, tp=2, ep=2), {}),
    "pp2xdp2": (Layout(pp=2, dp=2), {}),
    "pp2xtp2": (Layout(pp=2, tp=2), {}),
    "experts_over_tp_ep": (Layout(dp=2, tp=2, ep=2, experts_over_tp_ep=True), {}),
    "ep2_noncontiguous_recompute": (Layout(dp=2, ep=2), {"expert_map": [1, 0, 0, 1, 1, 0, 1, 0],
                                                        "tcfg": {"recompute": ("attention", "experts", "norms")}}),
    "tp4_kv_heads_replicated": (Layout(tp=4), {}),  # 2 KV heads: each replicated on 2 TP ranks
    # zero_stage=3: parameters sharded by rows over DP (experts over their replicas), gathered on use
    "dp2_zero3": (Layout(dp=2), {"tcfg": {"zero_stage": 3}}),
    "dp4xep2_zero3_recompute": (Layout(dp=4, ep=2), {"tcfg": {"zero_stage": 3,
                                                               "recompute": ("attention", "experts", "norms")}}),
    "tp2xep2_zero3": (Layout(dp=2, tp=2, ep=2), {"tcfg": {"zero_stage": 3}}),
    "pp2xdp2_zero3": (Layout(pp=2, dp=2), {"tcfg": {"zero_stage": 3}}),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_equals_single_process(name, model_dir, ref):
    layout, kw = LAYOUTS[name]
    results = run_ranks(worker, layout.world_size, layout, str(model_dir), dict(kw), timeout_s=240)
    check_against_reference(results, layout, ref)


def test_hierarchical_ep_equals_flat_exactly_and_crosses_nodes_less(model_dir, ref):
    """2 nodes x 2 ranks, EP over all 4: the same logprobs, gradients and parameters bit for bit as the
    flat all-to-all, with fewer bytes crossing the node boundary on dispatch."""
    layout = Layout(dp=4, ep=4)
    flat = run_ranks(worker, 4, layout, str(model_dir), {"ranks_per_node": 2}, timeout_s=240)
    hier = run_ranks(worker, 4, layout, str(model_dir), {"ranks_per_node": 2, "hierarchical_ep": True},
                     timeout_s=240)
    check_against_reference(hier, layout, ref)
    for f, h in zip(flat, hier):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(f["logp"], h["logp"]))
        for what in ("grads", "params"):
            assert all(torch.equal(f[what][n], h[what][n]) for n in f[what]), what
    for what in ("forward_inter_node", "bytes_inter_node"):
        f_bytes = sum(getattr(r["dispatch"], what) for r in flat)
        h_bytes = sum(getattr(r["dispatch"], what) for r in hier)
        assert 0 < h_bytes < f_bytes, (what, h_bytes, f_bytes)
    assert sum(r["dispatch"].backward_inter_node for r in hier) == sum(r["dispatch"].backward_inter_node for r in flat)


@pytest.mark.parametrize("name", ["ep2", "pp2", "ep2_noncontiguous_recompute"])
def test_bf16_compute_layout_equals_single_process_under_autocast(name, model_dir):
    """trainer.compute_dtype=bfloat16: the parallel trainer equals one process whose forwards run under torch's
    autocast, parameters, gradients and AdamW state in fp32 (recomputation reruns forwards under the same
    autocast). Logprobs within TOL (DP, EP and PP keep each token's forward bit for bit); gradients and
    parameters within TOL + RTOL_BF16 of each tensor's largest value: a weight's gradient is one bf16 matmul
    per micro-batch, and DP ranks hold other micro-batches."""
    layout, kw = LAYOUTS[name]
    ref = reference(model_dir, compute=torch.bfloat16)
    kw = dict(kw) | {"tcfg": kw.get("tcfg", {}) | {"compute_dtype": DType.bfloat16}}
    results = run_ranks(worker, layout.world_size, layout, str(model_dir), kw, timeout_s=240)
    check_against_reference(results, layout, ref, tol=TOL, rtol=RTOL_BF16)
    for res in results:
        assert all(g.dtype == torch.float32 for g in res["grads"].values())
        assert all(t.dtype == torch.float32 for t in res["params"].values())


def test_bf16_compute_with_tensor_parallelism_stays_within_bf16_rounding(model_dir, ref):
    """Tensor parallelism rounds each rank's partial sums (attention output, down projections) to bf16 before
    the all-reduce adds them, where one process rounds the whole sum once: most logprobs within a few bf16 ulps
    (median under 0.02 at these -3 to -8 logprobs of a random model with large weights), and where that tips a
    router's near-tie to another expert a token moves more (seen: 0.36). Such flips move the gradient norm by
    several percent either way (one process in bf16 against fp32: 1-3 % with this model, as attention's rounding
    tips one more tie or one fewer), so the norm is held to 1 % or to twice one process's own bf16 distance from
    fp32, whichever is larger: parallelism adds no more than bf16 itself does."""
    layout, kw = LAYOUTS["tp2xep2"]
    ref_bf16 = reference(model_dir, compute=torch.bfloat16)
    tol = max(RTOL_BF16 * ref_bf16["norm"], 2 * abs(ref_bf16["norm"] - ref["norm"]))
    results = run_ranks(worker, layout.world_size, layout, str(model_dir),
                        dict(kw) | {"tcfg": {"compute_dtype": DType.bfloat16}}, timeout_s=240)
    for res in results:
        assert abs(res["norm"] - ref_bf16["norm"]) <= tol, (res["norm"], ref_bf16["norm"], ref["norm"])
        if res["logp"] is not None:
            diff = (torch.cat([lp for lp, _ in res["logp"]]) - ref_bf16["logp"][res["rows"]]).abs()
            assert diff.median() <= 0.02 and diff.max() <= 1.0, (diff.median(), diff.max())


def test_optimizer_state_is_sharded_over_data_parallel_ranks(model_dir):
    single = run_ranks(worker, 1, Layout(), str(model_dir), {}, timeout_s=240)[0]["optimizer_state_bytes"]
    dp2 = [r["optimizer_state_bytes"] for r in run_ranks(worker, 2, Layout(dp=2), str(model_dir), {}, timeout_s=240)]
    assert all(0.45 * single <= b <= 0.55 * single for b in dp2), (single, dp2)


def test_zero3_shards_parameters_and_optimizer_state_over_data_parallel_ranks(model_dir):
    """zero_stage=3 keeps half the parameter bytes per rank at dp2 (no full copy stays resident after a
    step); AdamW state is split as with ZeRO-1."""
    single = run_ranks(worker, 1, Layout(), str(model_dir), {}, timeout_s=240)[0]
    dp2 = run_ranks(worker, 2, Layout(dp=2), str(model_dir), {"tcfg": {"zero_stage": 3}}, timeout_s=240)
    for r in dp2:
        assert 0.45 * single["param_bytes"] <= r["param_bytes"] <= 0.55 * single["param_bytes"], r["param_bytes"]
        assert 0.45 * single["optimizer_state_bytes"] <= r["optimizer_state_bytes"] <= 0.55 * single["optimizer_state_bytes"]


@pytest.fixture(scope="module")
def pangu_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_pangu")
    m = Qwen3MoeForCausalLM(PANGU)
    m.init_weights(seed=12, std=0.2, router_bias_std=0.3)
    save_pretrained(m, d)
    return d


@pytest.fixture(scope="module")
def pangu_ref(pangu_dir):
    return reference(pangu_dir)


PANGU_LAYOUTS = ("tp2", "ep2", "pp2", "tp2xep2", "pp2xtp2", "ep2_noncontiguous_recompute", "dp2_zero3",
                 "tp2xep2_zero3", "pp2xdp2_zero3")


@pytest.mark.parametrize("name", PANGU_LAYOUTS)
def test_pangu_layout_equals_single_process(name, pangu_dir, pangu_ref):
    """MLA heads and the shared expert split over TP, routed experts over EP, the MTP module carried on the last
    stage and never stepped, the router bias frozen: as one process within 1e-5."""
    layout, kw = LAYOUTS[name]
    results = run_ranks(worker, layout.world_size, layout, str(pangu_dir), dict(kw, cfg=PANGU), timeout_s=240)
    check_against_reference(results, layout, pangu_ref)
    frozen = [n for n in pangu_ref["params"] if "e_score_correction_bias" in n or n.startswith("model.layers.4.")]
    assert frozen and all(n not in pangu_ref["grads"] for n in frozen)


def test_router_bias_update_equals_single_process(pangu_dir):
    """trainer.router_bias_update_rate: each step's tokens per expert (counted once per token, recompute
    included) move every copy of the correction bias the same way as one process does: the biases, the
    routing they change and the AdamW steps after them equal one process within 1e-5."""
    rate = 0.05
    ref = reference(pangu_dir, router_bias_update_rate=rate)
    initial = Qwen3MoeForCausalLM(PANGU)
    initial.init_weights(seed=12, std=0.2, router_bias_std=0.3)
    biases = [n for n in ref["params"] if n.endswith("e_score_correction_bias") and "layers.4." not in n]  # not MTP's
    assert len(biases) == 3 and all((ref["params"][n] - initial.state_dict()[n]).abs().max() > rate / 2 for n in biases)
    _, attn, _ = make_batch()
    assert (ref["loads"].sum(1) == attn.sum() * PANGU.num_experts_per_tok).all()
    for name in ("ep2_noncontiguous_recompute", "pp2xtp2", "tp2xep2_zero3"):
        layout, kw = LAYOUTS[name]
        kw = dict(kw, tcfg=dict(kw.get("tcfg", {}), router_bias_update_rate=rate))
        results = run_ranks(worker, layout.world_size, layout, str(pangu_dir), dict(kw, cfg=PANGU), timeout_s=240)
        check_against_reference(results, layout, ref)
        for r in results:  # each stage's MoE layers: the stage's tokens summed over its ranks, as one process counted
            assert torch.equal(r["loads"], ref["loads"][r["moe_layers"]]), name
