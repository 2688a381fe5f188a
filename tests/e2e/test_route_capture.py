"""The engine's captured routes (routing replay R3) are the experts it really chose: they equal the trainer's
own top-k on the same tokens wherever the router's scores are not near a tie, for every sample of an n > 1
request, and they follow a weight update."""

import os

import pytest
import torch

from rlhf.config import load_model_config
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.hf_io import save_pretrained, to_hf_tensors
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.routing import Routing
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
    from actors.vllm_engine import VLLMEngine

    d = tmp_path_factory.mktemp("routes")
    m = _model(1)
    save_tokenizer(build_tokenizer(m.config.vocab_size), d)
    save_pretrained(m, d)
    e = VLLMEngine(str(d), RolloutConfig(max_new_tokens=10), max_model_len=64, capture_routes=True)
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
