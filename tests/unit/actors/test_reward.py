"""Reward workers, without Ray: rule verifiers score answers, the reward model scores prompt + response."""

import math

import pytest
import torch

from actors.reward import RewardModelWorker, RuleRewardWorker
from rlhf.schema import ModelConfig, RewardKind, SandboxConfig
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.model.reward_model import Qwen3MoeRewardModel, load_reward_model, save_reward_model


def test_exact_match_scores_the_leading_integer():
    out = RuleRewardWorker(RewardKind.exact_match).score(["12", "13", "no number"], ["12", "12", "12"])
    assert out.scores == [1.0, 0.0, 0.0]
    assert out.seconds >= 0 and out.start > 0


def test_math_verify_compares_symbolically_and_never_raises():
    import math_verify  # noqa: F401
    w = RuleRewardWorker(RewardKind.math_verify)
    responses = ["The answer is $\\frac{1}{2}$.", "so \\boxed{0.5}", "$\\frac{1}{3}$", "}}{{\\frac{", ""]
    out = w.score(responses, ["0.5", "\\frac{1}{2}", "0.5", "0.5", "0.5"], prompts=["p"] * 5)
    assert out.scores == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_a_rule_worker_refuses_the_model_kind():
    with pytest.raises(ValueError, match="not a rule verifier"):
        RuleRewardWorker(RewardKind.model)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rm")
    cfg = ModelConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, max_position_embeddings=64)
    model = Qwen3MoeRewardModel(cfg)
    model.init_weights(seed=5, std=0.2)
    save_tokenizer(build_tokenizer(cfg.vocab_size), d / "tok")
    save_reward_model(model, d, tokenizer_dir=d / "tok")
    return d


def test_reward_model_worker_scores_prompt_plus_response(reward_dir):
    w = RewardModelWorker(str(reward_dir), batch_size=2)
    prompts = ["3+4=", "10-7=", "2*2=", "9+9="]
    responses = ["7", "3", "5 5 5 5 5 5 5 5", ""]
    out = w.score(responses, ["7", "3", "4", "18"], prompts=prompts)
    assert len(out.scores) == 4
    assert all(isinstance(s, float) and math.isfinite(s) for s in out.scores)
    assert out.seconds >= 0

    # Each score is the model's on that text alone: batching, sorting and padding change nothing.
    model, tok = load_reward_model(reward_dir).eval(), w.tok
    with torch.no_grad():
        alone = [model(torch.tensor([tok.encode(p + r).ids])).item() for p, r in zip(prompts, responses)]
    assert out.scores == pytest.approx(alone, abs=1e-5)
    assert len(set(out.scores)) == 4, "different texts should score differently"
    # The prompt is scored too; without prompts the response is scored alone.
    assert w.score(responses, ["0"] * 4).scores != pytest.approx(out.scores, abs=1e-6)


def test_reward_model_worker_cuts_long_texts(reward_dir):
    w = RewardModelWorker(str(reward_dir), max_tokens=5)
    long, cut = w.score(["1" * 200, "1111"], ["", ""]).scores
    assert long == pytest.approx(cut, abs=1e-5), "both are <bos> + 4 tokens after the cut"


def test_reward_model_worker_wants_one_answer_per_response(reward_dir):
    with pytest.raises(ValueError, match="one of each per response"):
        RewardModelWorker(str(reward_dir)).score(["1", "2"], ["1"])


def test_a_rule_reward_worker_does_not_load_torch():
    """The rule reward worker's process holds 0.12 GiB instead of 0.3 when nothing it imports loads torch
    (`actors.replies` names torch in annotations only)."""
    import subprocess
    import sys

    code = "import sys, actors.reward; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_code_worker_runs_each_program_against_its_tests():
    from rlhf.schema import SandboxConfig

    w = RuleRewardWorker(RewardKind.code, SandboxConfig(timeout_s=2.0, processes=2))
    tests = "assert sq(3) == 9"
    out = w.score(["```python\ndef sq(x):\n    return x * x\n```", "def sq(x):\n    return 2 * x\n", "while True: pass"],
                  [tests, tests, tests], prompts=["p"] * 3)
    assert out.scores == [1.0, 0.0, 0.0]
    assert out.verdicts == {"passed": 1, "failed": 1, "timeout": 1}
    assert RuleRewardWorker(RewardKind.exact_match).score(["1"], ["1"]).verdicts == {}
    with pytest.raises(ValueError, match="one answer per response"):
        w.score(["a"], [])


def test_accuracy_is_scored_by_the_runs_rule_or_by_exact_match_under_a_reward_model():
    from rlhf.data.verifiers import accuracy_scores
    from rlhf.schema import RewardConfig

    tests = '{"inputs": [""], "outputs": ["12"]}'
    assert accuracy_scores(RewardConfig(kind=RewardKind.code), ["print(12)", "12"], [tests, tests]) == [1.0, 0.0]
    assert accuracy_scores(RewardConfig(kind=RewardKind.model, model_path="/rm"), ["12", "13"], ["12", "12"]) == [1.0, 0.0]
    # partial credit rewards half a solution; accuracy counts solved tasks only
    two = '{"inputs": ["1", "2"], "outputs": ["12", "12"]}'
    partial = RewardConfig(kind=RewardKind.code, sandbox=SandboxConfig(partial_credit=True))
    prog = "print(12 if input() == '1' else 0)"
    assert RuleRewardWorker(RewardKind.code, partial.sandbox).score([prog], [two], ["p"]).scores == [0.5]
    assert accuracy_scores(partial, [prog, "print(12)"], [two, two]) == [0.0, 1.0]


def test_a_code_worker_removes_the_precompiled_headers_of_killed_workers_and_scores_cpp():
    import os
    import tempfile

    from rlhf.data.sandbox_cpp import PCH_PREFIX

    dead = tempfile.mkdtemp(prefix=f"{PCH_PREFIX}{2**22 + 54321}-")  # above any pid: a worker killed earlier
    w = RuleRewardWorker(RewardKind.code, SandboxConfig(timeout_s=3.0, cpp_precompiled_header=""))
    assert not os.path.exists(dead)
    program = "```cpp\n#include <cstdio>\nint main() { int a; scanf(\"%d\", &a); printf(\"%d\\n\", 2 * a); }\n```"
    out = w.score([program], ['{"inputs": ["21"], "outputs": ["42"]}'])
    assert out.scores == [1.0] and out.verdicts["passed"] == 1
