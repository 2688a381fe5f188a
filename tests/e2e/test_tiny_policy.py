"""The tiny world end to end: `rlhf make-tiny` builds a policy in range; vLLM agrees with our model on it."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_make_tiny_size_accuracy_and_files(tiny):
    d, summary = tiny
    assert 0.2e6 <= summary["params"] <= 2e6
    assert 0.05 <= summary["heldout_accuracy"] <= 0.60
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "heldout.jsonl",
              "train.jsonl"):
        assert (d / f).is_file(), f
    assert sum(1 for _ in (d / "heldout.jsonl").open()) == 256


@pytest.mark.vllm
def test_vllm_greedy_equals_our_model(tiny, tmp_path, run_rlhf):
    d, summary = tiny
    run = tmp_path / "run.yaml"
    run.write_text(f"""
defaults:
  model: {REPO / 'configs/model/qwen3_moe_tiny.yaml'}
model:
  path: {d}
data:
  train_files: [{d / 'train.jsonl'}]
  heldout_files: [{d / 'heldout.jsonl'}]
  prompts_per_step: 8
algorithm:
  group_size: 4
trainer:
  mini_batch_size: 32
""")
    result = run_rlhf("eval", run)
    assert result["greedy_agreement"] == 1.0  # every held-out greedy completion token-identical
    assert result["heldout_accuracy_vllm"] == result["heldout_accuracy_torch"] == summary["heldout_accuracy"]
    assert result["rollout_samples"] == 32
    assert 0.0 < result["rollout_reward_mean"] < 1.0  # sampled rollouts carry GRPO signal
