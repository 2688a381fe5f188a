"""The engine's captured routes (routing replay R3) are the experts it really chose: they equal the trainer's
own top-k on the same tokens wherever the router's scores are not near a tie, for every sample of an n > 1
request, and they follow a weight update."""

import os
from dataclasses import replace

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.moe.routing import Routing
from rlhf.schema import RolloutConfig

pytestmark = pytest.mark.vllm
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
TIE = 1e-4  # top-k sets are compared only where the k-th and (k+1)-th router probabilities differ by more


def _model(seed):
    cfg = load_model_config(os.path.join(CONFIGS, "model", "qwen3_moe_tiny.yaml"))
    m = Qwen3MoeForCausalLM(cfg).eval()
    m.init_weights(seed, std=0.1)
    return m


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from actors.vllm.engine import VLLMEngine

    d = tmp_path_factory.mktemp("routes")
    m = _model(1)
    save_tokenizer(build_tokenizer(m.config.vocab_size), d)
    save_pretrained(m, d)
    e = VLLMEngine(str(d), RolloutConfig(max_new_tokens=10, cpu_kv_cache_gib=0.25), max_model_len=64, capture_routes=True)
    yield e
    e.close()


def _trainer_routes(model, seq):
    """(live top-k [T, L, k], whether each (token, layer) is clear of a near-tie [T, L])."""
    gaps = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, args, out: gaps.append(mod.scores(args[0])[1].topk(mod.top_k + 1).values))
        for layer in model.model.layers if layer.is_moe]
    r = Routing(record=True)
    ids = torch.tensor([seq])
    with torch.no_grad():
        model(ids, routing=r)
    for h in hooks:
        h.remove()
    L, k = len(gaps), model.config.num_experts_per_tok
    clear = torch.stack([(g[:, k - 1] - g[:, k]) > TIE for g in gaps], dim=1)
    return r.chosen_BTLk(1, len(seq), L, k)[0], clear


def check_routes(model, prompts, completions):
    compared = agree = 0
    for c in completions:
        seq = list(prompts[c.prompt_index]) + list(c.token_ids)
        assert c.routes is not None and c.routes.shape[0] == len(seq) - 1, "a route per token fed to the model"
        want, clear = _trainer_routes(model, seq[:-1])
        got = torch.as_tensor(c.routes).long()
        same = (got.sort(-1).values == want.long().sort(-1).values).all(-1)
        compared += int(clear.sum())
        agree += int((same & clear).sum())
    assert compared > 0.9 * sum(c.routes.shape[0] * c.routes.shape[1] for c in completions)
    assert agree == compared, f"{compared - agree} of {compared} clear (token, layer) routes differ"


def test_captured_routes_are_the_engines_choices_and_follow_updates(engine):
    prompts = [[1, 5, 9, 13], [1, 7, 7, 21, 30, 2, 11, 8, 19], [1, 3]]
    m1 = _model(1)
    outs = engine.generate(prompts, n=3, seed=0)
    assert len(outs) == 9 and outs[0].routes.dtype.name == "uint8"
    check_routes(m1, prompts, outs)

    m2 = _model(2)
    engine.update_weights([(n, t.clone()) for n, t in to_hf_tensors(m2.state_dict(), m2.config)], version=1)
    outs = engine.generate(prompts, n=2, seed=1)
    check_routes(m2, prompts, outs)
    with pytest.raises(AssertionError):
        check_routes(m1, prompts, outs)  # the old weights' routes are not the engine's any more


def test_routes_kept_apart_in_blocks_per_trainer_stage(engine):
    """`generate_routed` (what `rlhf train` calls): the completions carry only each sample's place in one
    block per trainer stage, and the blocks hold exactly the routes `generate` returns, over the stage's MoE
    layers; an evaluation's routes (`keep_routes=False`) are dropped, and do not leak into the next call."""
    from rlhf.moe.routing import RouteFetch, RouteRef

    prompts = [[1, 5, 9, 13], [1, 7, 7, 21, 30, 2, 11, 8, 19], [1, 3]]
    whole = engine.generate(prompts, n=2, seed=4)
    assert all(c.routes is None for c in engine.generate(prompts, n=1, seed=0, temperature=0.0, keep_routes=False))
    stages = [[0, 1], [2]]  # a pp2 trainer's MoE layers
    comps, *blocks = engine.generate_routed(prompts, stages, n=2, seed=4)
    assert [c.token_ids for c in comps] == [c.token_ids for c in whole]
    assert all(isinstance(c.routes, RouteRef) and c.routes.blocks == () for c in comps)
    assert [b.shape[1] for b in blocks] == [2, 1] and blocks[0].dtype.name == "uint8"
    for c, w in zip(comps, whole):
        r = c.routes
        assert r.positions == w.routes.shape[0]
        for b, layers in zip(blocks, stages):
            assert (b[r.start:r.start + r.positions] == w.routes[:, layers]).all()
    # a trainer rank of stage 1 reading rows 1 and 4 through the references (here names of the blocks)
    store = {"stage0": blocks[0], "stage1": blocks[1]}
    refs = [replace(c.routes, blocks=("stage0", "stage1")) for c in comps]
    T = max(len(prompts[c.prompt_index]) + len(c.token_ids) for c in comps)
    share = RouteFetch((1, 4), (refs[1], refs[4]), 1, (2,), 3, 2, T).resolve(lambda names: [store[n] for n in names])
    for i, row in enumerate((1, 4)):
        n = whole[row].routes.shape[0]
        assert (share.routes_RTLk[i, :n, 0].numpy() == whole[row].routes[:, 2]).all()
        assert (share.routes_RTLk[i, n:] == -1).all()


def test_routes_of_a_prefix_served_from_the_cache_are_those_that_computed_it(tmp_path):
    """Prefix caching on with route capture (multi-turn episodes continue from their cached turns): a request
    whose prefix the cache serves runs no forward for it, and its routes there are the ones captured when those
    KV blocks were computed (by KV slot): every route is the engine's choice, and a turn continuing from an
    earlier one's context has exactly the earlier call's routes on the shared positions."""
    import numpy as np

    from actors.vllm.engine import VLLMEngine

    m = _model(1)
    save_tokenizer(build_tokenizer(m.config.vocab_size), tmp_path)
    save_pretrained(m, tmp_path)
    e = VLLMEngine(str(tmp_path), RolloutConfig(max_new_tokens=8, cpu_kv_cache_gib=0.25, block_size=32),
                   max_model_len=128, capture_routes=True, whole_prefills=True)
    try:
        first = [[1] + [(7 * i) % 25 + 3 for i in range(40)]]
        a = e.generate(first, n=3, seed=0)  # three samples of one prompt: the later ones may read its blocks
        check_routes(m, first, a)
        second = [first[0] + list(a[0].token_ids) + [5, 9, 11]]  # the next turn: its context, then new tokens
        b = e.generate(second, n=1, seed=1)
        assert b[0].cached_tokens >= 32  # whole blocks of the first call served from the cache
        check_routes(m, second, b)
        shared = len(first[0]) + len(a[0].token_ids) - 1
        assert np.array_equal(b[0].routes[:shared], a[0].routes[:shared])
    finally:
        e.close()
