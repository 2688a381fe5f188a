"""Our DeepSeek-V3 / Pangu Ultra MoE decoder (`architecture: pangu_moe`) equals transformers'
DeepseekV3ForCausalLM on the same weights (fp32, <= 1e-5), over the shapes the family uses."""

import json

import pytest
import torch
import transformers

from rlhf.model.hf_io import from_hf_tensors, iter_safetensors, load_config, load_pretrained, save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.schema import Architecture, Attention, MLAConfig, ModelConfig, RopeScaling, RouterScoring
from tests.unit.rlhf.model.test_qwen3_moe import assert_logits_equal

MLA = MLAConfig(q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
YARN = RopeScaling(factor=40.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=1.0)  # the public DeepSeek-V3 settings, the original context shrunk to the test's
CASES = {
    "q_lora_dense_first_shared": dict(),
    "no_q_lora_groups": dict(mla=MLAConfig(q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                           v_head_dim=8), first_k_dense_layers=0, n_group=4, topk_group=2,
                             num_experts_per_tok=3),
    "yarn_two_dense_no_norm": dict(rope_scaling=YARN, first_k_dense_layers=2, norm_topk_prob=False,
                                   max_position_embeddings=320),
    "top1_two_groups_two_shared": dict(num_shared_experts=2, num_experts_per_tok=1, n_group=2, topk_group=1,
                                       routed_scaling_factor=1.0),
}


def ds_cfg(**kw) -> ModelConfig:
    mla = kw.get("mla", MLA)
    base = dict(architecture=Architecture.pangu_moe, attention=Attention.mla, router_scoring=RouterScoring.sigmoid,
                mla=mla, vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48, first_k_dense_layers=1,
                num_shared_experts=1, shared_expert_intermediate_size=32, n_group=1, topk_group=1,
                routed_scaling_factor=2.5, rope_theta=10000.0, rms_norm_eps=1e-6)
    return ModelConfig(**(base | kw))


def _model(cfg, seed=7):
    model = Qwen3MoeForCausalLM(cfg).eval()
    # large weights: routing and attention far from uniform; a nonzero bias, as a trained router's, moves the choice
    model.init_weights(seed=seed, std=0.2, router_bias_std=0.3)
    return model


@pytest.mark.parametrize("case", CASES)
def test_logits_equal_transformers(tmp_path, case):
    cfg = ds_cfg(**CASES[case])
    ours = _model(cfg)
    save_pretrained(ours, tmp_path)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                     output_loading_info=True)
    theirs.eval()
    assert type(theirs).__name__ == "DeepseekV3ForCausalLM"
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert_logits_equal(ours, theirs, cfg.vocab_size)


def test_config_round_trips_and_the_model_reloads_bit_exactly(tmp_path):
    cfg = ds_cfg(rope_scaling=YARN, n_group=4, topk_group=2, num_mtp_layers=1, max_position_embeddings=320)
    ours = _model(cfg)
    save_pretrained(ours, tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["model_type"] == "deepseek_v3" and on_disk["num_nextn_predict_layers"] == 1
    assert load_config(tmp_path) == ModelConfig(**{**cfg.__dict__, "name": tmp_path.name})
    back = load_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), back.state_dict().values()))
    assert list(back.state_dict()) == list(ours.state_dict())


def test_mtp_modules_are_carried_under_their_checkpoint_names_and_never_trained(tmp_path):
    cfg = ds_cfg(num_mtp_layers=1)
    ours = _model(cfg)
    save_pretrained(ours, tmp_path)
    names = [n for n, _ in iter_safetensors(tmp_path)]
    L = cfg.num_hidden_layers
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
        assert f"model.layers.{L}.{part}" in names
    assert not any(n.startswith(f"model.layers.{L + 1}.") for n in names)
    state = from_hf_tensors(iter_safetensors(tmp_path), cfg)
    assert state[f"model.layers.{L}.mlp.experts.gate_up_proj"].shape[0] == cfg.num_experts  # stacked as ours
    # transformers' DeepseekV3ForCausalLM builds no MTP module: those tensors are all it leaves aside
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["unexpected_keys"] and all(k.startswith(f"model.layers.{L}.") for k in info["unexpected_keys"])
    assert not info["missing_keys"]
    # the forward does not run them and no gradient reaches them
    ours(torch.randint(0, cfg.vocab_size, (2, 7))).logsumexp(-1).mean().backward()
    mtp = {n: p for n, p in ours.named_parameters() if n.startswith(f"model.layers.{L}.")}
    assert mtp and all(not p.requires_grad and p.grad is None for p in mtp.values())


def test_gradients_flow_to_every_trained_parameter_and_the_router_bias_is_frozen():
    cfg = ds_cfg(n_group=4, topk_group=2)
    model = _model(cfg)
    model(torch.randint(0, cfg.vocab_size, (4, 16))).logsumexp(-1).mean().backward()
    dead = [n for n, p in model.named_parameters()
            if p.requires_grad and not (p.grad is not None and p.grad.abs().sum() > 0)]
    assert dead == []
    frozen = sorted(n for n, p in model.named_parameters() if not p.requires_grad)
    assert frozen == [f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)]


def _router(seed: int, tokens: int):
    """A group-limited router (8 experts in 4 groups, top-2 from the best 2) with random weights and bias."""
    from rlhf.model.qwen3_moe import GroupLimitedRouter

    cfg = ds_cfg(num_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    router = GroupLimitedRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.5)
    return cfg, router, torch.randn(tokens, cfg.hidden_size, generator=g)


def test_group_limited_routing_picks_only_from_the_best_groups():
    cfg, router, x = _router(3, 200)
    weights, experts, live = router(x)
    choice = torch.sigmoid(x @ router.weight.T) + router.e_score_correction_bias
    group_score = choice.view(200, 4, 2).sum(-1)  # two experts per group: its two best are both
    best_groups = group_score.topk(2, dim=-1).indices
    assert ((experts // 2)[..., None] == best_groups[:, None]).any(-1).all()
    scores = torch.sigmoid(x @ router.weight.T)
    want = scores.gather(1, experts)
    assert torch.allclose(weights, want / want.sum(-1, keepdim=True) * cfg.routed_scaling_factor, atol=1e-6)
    assert torch.equal(experts, live)


def test_replaying_routes_through_the_group_limited_router():
    """Routing replay on the sigmoid router: forcing its own live choice gives the live weights bit for bit;
    forcing other experts (even outside the best groups) weights them by their live unbiased scores and the
    router weight still gets a gradient."""
    cfg, router, x = _router(5, 64)
    w, e, live = router(x)
    w2, e2, live2 = router(x, live.to(torch.int16))
    assert torch.equal(w, w2) and torch.equal(e, e2) and torch.equal(live, live2)
    forced = (live + 4) % 8  # other experts, mostly in groups the live choice dropped
    forced[:8] = -1  # rows without a route keep the live choice
    w3, e3, live3 = router(x, forced.to(torch.int16))
    assert torch.equal(e3[8:], forced[8:]) and torch.equal(e3[:8], live[:8]) and torch.equal(live3, live)
    scores = torch.sigmoid(x @ router.weight.T).gather(1, e3)
    assert torch.allclose(w3, scores / scores.sum(-1, keepdim=True) * cfg.routed_scaling_factor, atol=1e-6)
    w3[:, 0].sum().backward()  # (the sum over k is constant after renormalisation)
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 1e-3


def test_router_bias_update_moves_the_choice_toward_balance():
    """DeepSeek-V3's auxiliary-loss-free update: overloaded experts' bias down by the rate, underloaded up, an
    expert at the mean unchanged; repeated, it spreads a skewed router's tokens over more experts."""
    from rlhf.model.qwen3_moe import router_bias_update

    bias = torch.tensor([0.0, 0.1, -0.2, 0.0])
    new = router_bias_update(bias, torch.tensor([10, 2, 4, 0]), 0.01)
    assert torch.allclose(new, torch.tensor([-0.01, 0.11, -0.2, 0.01]))
    cfg, router, x = _router(7, 512)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        u = torch.ones(cfg.hidden_size) / cfg.hidden_size ** 0.5
        x += 2 * u
        router.weight[:2] += 2 * u  # experts 0 and 1 (group 0) chosen by most tokens
    loads = torch.bincount(router(x)[1].flatten(), minlength=8)
    before = loads.max() / loads.float().mean()
    for _ in range(100):
        with torch.no_grad():
            router.e_score_correction_bias.copy_(router_bias_update(router.e_score_correction_bias, loads, 0.01))
        loads = torch.bincount(router(x)[1].flatten(), minlength=8)
    assert before > 1.5 and loads.max() / loads.float().mean() < 0.8 * before, (before, loads)


def test_a_training_forward_counts_each_token_once_and_recompute_does_not_count_again():
    from torch.utils.checkpoint import checkpoint

    cfg = ds_cfg(n_group=4, topk_group=2)
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 10))
    with torch.no_grad():
        model(ids)  # an evaluation forward: not part of a step
    blocks = [l.mlp for l in model.model.layers[:cfg.num_hidden_layers] if l.is_moe]
    assert all(b.step_tokens_per_expert is None for b in blocks)
    checkpoint(model, ids, use_reentrant=False).logsumexp(-1).mean().backward()  # reruns every forward
    model(ids).sum()
    assert all((b.step_tokens_per_expert.sum() == 2 * ids.numel() * cfg.num_experts_per_tok) for b in blocks)
