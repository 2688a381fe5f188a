"""The reward model equals transformers' Qwen3MoeForSequenceClassification (num_labels=1) on the same
weights (fp32, <= 1e-5), and its HF directories round-trip bit-exactly."""

import json
from dataclasses import replace

import pytest
import torch

from rlhf.schema import DType, ModelConfig
from rlhf.model.hf_io import INDEX_FILE, save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.model.reward_model import Qwen3MoeRewardModel, load_reward_model, save_reward_model

CASES = {
    "base": dict(),
    "tied_dense_first": dict(tie_word_embeddings=True, first_k_dense_layers=1),
    "mqa_top1": dict(num_key_value_heads=1, num_experts_per_tok=1, num_experts=5, norm_topk_prob=False),
}


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=48,
                rope_theta=10000.0)
    return ModelConfig(**(base | kw))


def tiny_reward_model(cfg: ModelConfig, seed: int = 7) -> Qwen3MoeRewardModel:
    model = Qwen3MoeRewardModel(cfg).eval()
    model.init_weights(seed=seed, std=0.2)  # large weights: routing and attention far from uniform
    return model


def right_padded(cfg: ModelConfig, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tokens never equal pad_token_id, so transformers' pad detection finds the same last token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), cfg.pad_token_id)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(cfg.pad_token_id + 1, cfg.vocab_size, (n,), generator=g)
        mask[b, :n] = 1
    return ids, mask


@pytest.mark.parametrize("case", CASES)
def test_scores_equal_transformers(tmp_path, case):
    import transformers
    cfg = tiny_cfg(**CASES[case])
    ours = tiny_reward_model(cfg)
    save_reward_model(ours, tmp_path)
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForSequenceClassification" and theirs.config.num_labels == 1
    assert set(theirs.state_dict()) == set(ours.state_dict()), "parameter names differ from transformers'"

    ids, mask = right_padded(cfg, [13, 9, 4, 1, 13])
    with torch.no_grad():
        scores_B = ours(ids, mask)
        want_B = theirs(ids, attention_mask=mask).logits.squeeze(-1)
        assert scores_B.shape == (5,)
        assert (scores_B - want_B).abs().max().item() <= 1e-5
        alone = torch.stack([ours(ids[b:b + 1, :n]) for b, n in enumerate(mask.sum(1).tolist())]).squeeze(-1)
        assert (scores_B - alone).abs().max().item() <= 1e-5, "padding changed a sequence's score"


@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": True, "first_k_dense_layers": 1},
                                {"dtype": DType.bfloat16}])
@pytest.mark.parametrize("max_shard_bytes", [2 << 30, 20_000])
def test_save_load_round_trip_is_bit_exact(tmp_path, kw, max_shard_bytes):
    cfg = tiny_cfg(**kw)
    model = tiny_reward_model(cfg, seed=3)
    if cfg.dtype is DType.bfloat16:
        model = model.to(torch.bfloat16)
    save_reward_model(model, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / INDEX_FILE).is_file() == (max_shard_bytes < 2 << 30)
    back = load_reward_model(tmp_path)
    assert back.config == replace(cfg, name=tmp_path.name)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    ids, mask = right_padded(cfg, [7, 3])
    # Equal weights, yet not always bit-equal scores: BLAS may round differently for a tensor read from disk
    # that is not 64-byte aligned.
    with torch.no_grad():
        atol = 1e-2 if cfg.dtype is DType.bfloat16 else 1e-6
        assert torch.allclose(back(ids, mask), model(ids, mask), rtol=0, atol=atol)


def test_config_json_names_the_classifier(tmp_path):
    import transformers
    save_reward_model(tiny_reward_model(tiny_cfg()), tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["architectures"] == ["Qwen3MoeForSequenceClassification"] and on_disk["num_labels"] == 1
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "qwen3_moe" and hf.num_labels == 1


def test_loads_a_directory_transformers_wrote(tmp_path):
    import transformers
    cfg = tiny_cfg(first_k_dense_layers=1)
    save_reward_model(tiny_reward_model(cfg), tmp_path / "ours")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    theirs.save_pretrained(tmp_path / "theirs")
    back = load_reward_model(tmp_path / "theirs")
    ids, mask = right_padded(cfg, [6, 11, 2])
    with torch.no_grad():
        want_B = theirs.eval()(ids, attention_mask=mask).logits.squeeze(-1)
        assert (back(ids, mask) - want_B).abs().max().item() <= 1e-5


def test_a_policy_directory_is_refused(tmp_path):
    save_pretrained(Qwen3MoeForCausalLM(tiny_cfg()), tmp_path)
    with pytest.raises(ValueError, match="Qwen3MoeForSequenceClassification"):
        load_reward_model(tmp_path)


def test_a_sequence_without_real_tokens_is_refused():
    cfg = tiny_cfg()
    ids, mask = right_padded(cfg, [4, 2])
    mask[1] = 0
    with pytest.raises(ValueError, match="at least one real token"):
        tiny_reward_model(cfg)(ids, mask)
