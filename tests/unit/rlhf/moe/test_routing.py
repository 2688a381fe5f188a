"""Routing replay in the model: forcing a forward's own routes changes nothing, forcing others changes the
output while the router keeps its gradient, and the mismatch statistics count what differs."""

import torch

from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.moe.routing import Routing, RouteStats, sets_differ
from rlhf.schema import ModelConfig

CFG = ModelConfig(vocab_size=48, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
                  first_k_dense_layers=1)  # 3 MoE layers after a dense one
L, K = CFG.num_hidden_layers - 1, CFG.num_experts_per_tok


def _model():
    m = Qwen3MoeForCausalLM(CFG)
    m.init_weights(seed=3, std=0.2)
    return m


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # right padding
    return ids, mask


def _recorded(model, ids, mask):
    r = Routing(record=True)
    with torch.no_grad():
        logits = model(ids, mask, routing=r)
    return logits, r.chosen_BTLk(*ids.shape, L, K)


def test_replaying_own_routes_is_bit_exact():
    model, (ids, mask) = _model(), _batch()
    logits, routes = _recorded(model, ids, mask)
    assert routes.dtype == torch.int16 and (routes >= 0).all()
    with torch.no_grad():
        replayed = model(ids, mask, routing=Routing(forced_BTLk=routes))
    assert torch.equal(replayed, logits)
    assert torch.equal(model(ids, mask).detach(), logits)  # and no routing at all is the same forward


def test_other_routes_change_the_output_and_keep_router_gradients():
    model, (ids, mask) = _model(), _batch()
    logits, routes = _recorded(model, ids, mask)
    forced = (routes.long() + K) % CFG.num_experts  # other experts (a shift by k never maps a set onto itself)
    assert sets_differ(forced.view(-1, K), routes.view(-1, K)).all()
    forced[0, :4] = -1  # unforced rows use the live top-k
    out = model(ids, mask, routing=Routing(forced_BTLk=forced.to(torch.int16)))
    assert not torch.allclose(out, logits)
    with torch.no_grad():  # row 0's first four tokens see only unforced tokens (an expert's rows batch
        assert (out[0, :4] - logits[0, :4]).abs().max() <= 1e-5  # differently, hence not bit for bit)
    out[mask.bool()].logsumexp(-1).sum().backward()
    for layer in model.model.layers[1:]:
        g = layer.mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0
        rows = forced[:, :, layer.mlp.moe_index].reshape(-1, K)
        used = torch.zeros(CFG.num_experts, dtype=torch.bool)
        used[rows[rows >= 0].long()] = True
        assert (g[used].abs().sum(1) > 0).all()  # every replayed expert's router row gets a gradient


def test_differs_counts_layers_that_chose_another_set():
    model, (ids, mask) = _model(), _batch()
    _, routes = _recorded(model, ids, mask)
    engine = routes.clone()
    engine[0, 2, 1] = (engine[0, 2, 1] + K) % CFG.num_experts  # token (0, 2): layer 1 differs
    engine[2, 5, :] = (engine[2, 5, :] + K) % CFG.num_experts  # token (2, 5): every layer differs
    engine[1, 3, 0] = engine[1, 3, 0].flip(-1)  # same set, other order: not a mismatch
    engine[:, -1] = -1  # no engine route for the last token
    r = Routing(engine_BTLk=engine)
    with torch.no_grad():
        model(ids, mask, routing=r)
    d = r.differ_count_BT(*ids.shape)
    assert d[0, 2] == 1 and d[2, 5] == L and int(d.sum()) == 1 + L
    stats = RouteStats.of(d, engine)
    tokens = ids.shape[0] * (ids.shape[1] - 1)
    assert stats.token_layers == tokens * L
    assert abs(stats.mismatch - (1 + L) / (tokens * L)) < 1e-12
    assert abs(stats.tokens_any_mismatch - 2 / tokens) < 1e-12
