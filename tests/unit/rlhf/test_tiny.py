import dataclasses
from pathlib import Path

import pytest

from rlhf.config import ConfigError, load_run_config
from rlhf.schema import ModelConfig
from rlhf.model.hf_io import check_model_dir
from rlhf.config import load_model_config
from rlhf.tiny import TinySpec, make_tiny, sft_init_std

QUICK = TinySpec(n_sft=400, n_train=40, n_heldout=16, max_sft_steps=6, eval_every=3, batch_size=16,
                 target_accuracy=1.0, min_accuracy=0.0)
CFG = ModelConfig(hidden_size=32, num_hidden_layers=1, num_experts=4, moe_intermediate_size=32)
CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_make_tiny_is_deterministic_for_a_seed(tmp_path):
    a = make_tiny(tmp_path / "a", CFG, QUICK, log=lambda m: None)
    b = make_tiny(tmp_path / "b", CFG, QUICK, log=lambda m: None)
    make_tiny(tmp_path / "c", CFG, dataclasses.replace(QUICK, seed=1), log=lambda m: None)
    for f in ("model.safetensors", "train.jsonl", "heldout.jsonl", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()
    assert a["heldout_accuracy"] == b["heldout_accuracy"] and a["sft_steps"] == 6


def test_run_refuses_a_policy_dir_of_another_shape(tmp_path):
    make_tiny(tmp_path / "p", CFG, QUICK, log=lambda m: None)
    cfg = load_run_config(CONFIGS / "tiny_cpu.yaml", [f"model.path={tmp_path / 'p'}"])
    with pytest.raises(ConfigError, match=r"hidden_size: config 96, .*config.json 32"):
        check_model_dir(cfg.model)
    with pytest.raises(ConfigError, match="rlhf make-tiny"):
        check_model_dir(load_run_config(CONFIGS / "tiny_cpu.yaml", [f"model.path={tmp_path / 'none'}"]).model)


def test_the_warm_start_of_latent_attention_starts_from_a_wider_init():
    # MLA has no per-head q / k norm: at std 0.02 its first attention scores are near zero (docs/tiny_world.md)
    assert sft_init_std(load_model_config(CONFIGS / "model" / "pangu_moe_tiny.yaml")) == 0.1
    assert sft_init_std(load_model_config(CONFIGS / "model" / "qwen3_moe_tiny.yaml")) == TinySpec.init_std == 0.02


def test_the_code_task_teaches_print_and_writes_tests_the_sandbox_runs(tmp_path):
    import json

    from rlhf.data.sandbox import check, parse_tests
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.schema import SandboxConfig
    from rlhf.tiny import sft_target

    s = make_tiny(tmp_path / "code", CFG, dataclasses.replace(QUICK, task="code"), log=lambda m: None)
    rows = [json.loads(line) for line in (tmp_path / "code" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == QUICK.n_train and 0.0 <= s["heldout_accuracy"] <= 1.0
    prompt, tests = rows[0]["prompt"], rows[0]["answer"]
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    assert parse_tests(tests).cases == (("", str(a + b)),)
    # what the warm start teaches passes the row's test in the sandbox; the sum's bare digits do not
    from rlhf.data.arithmetic import Problem
    [(target, written)] = sft_target(Problem(prompt, str(a + b)), "code")
    assert target == f"print({a + b})" and written
    assert check(target, tests, SandboxConfig(timeout_s=5.0)).score == 1.0
    assert check(str(a + b), tests, SandboxConfig(timeout_s=5.0)).score == 0.0
    tok = load_tokenizer(tmp_path / "code")
    assert tok.decode(tok.encode(target, add_special_tokens=False).ids) == target  # every character has a token
    with pytest.raises(ValueError, match="task 'sql'"):
        make_tiny(tmp_path / "x", CFG, dataclasses.replace(QUICK, task="sql"), log=lambda m: None)


def test_a_missing_policy_is_named_with_the_make_tiny_command_its_run_needs(tmp_path):
    from rlhf.tiny import make_tiny_args

    for config, args in (("tiny_cpu.yaml", "`"), ("tiny_cpu_code.yaml", " --task code`"),
                         ("tiny_cpu_pangu.yaml", " --model pangu_moe_tiny`"), ("tiny_cpu_tool.yaml", " --task tool`")):
        cfg = load_run_config(CONFIGS / config, [f"model.path={tmp_path / 'none'}"])
        with pytest.raises(ConfigError, match=f"rlhf make-tiny {tmp_path / 'none'}{args}"):
            check_model_dir(cfg.model, make_tiny_args(cfg))


def test_the_tool_task_teaches_the_call_and_the_copy_but_not_the_result(tmp_path):
    """`--task tool`: the warm start's sequence is the calculator episode token for token (prompt, call, the
    environment's result, the copy, EOS), trained on what the policy writes only; the tags are whole tokens."""
    import json

    from rlhf.agents.calculator import Calculator
    from rlhf.data.arithmetic import Problem
    from rlhf.data.tokenizer import load_tokenizer
    from rlhf.tiny import TOOL_WORDS, _sft_batch

    s = make_tiny(tmp_path / "tool", CFG, dataclasses.replace(QUICK, task="tool"), log=lambda m: None)
    assert 0.0 <= s["heldout_accuracy"] <= 1.0 and 0.0 <= s["heldout_accuracy_with_call"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "tool" / "train.jsonl").read_text().splitlines()]
    assert max(len(r["answer"]) for r in rows) >= 5  # sums of up to 5-digit numbers
    tok = load_tokenizer(tmp_path / "tool")
    assert [tok.encode(w, add_special_tokens=False).ids for w in TOOL_WORDS] == [[tok.token_to_id(w)] for w in TOOL_WORDS]
    p = Problem("12345+678=", "13023")
    ids, attn, mask = _sft_batch(tok, [p, p], eos=2, pad=0, task="tool", direct=[False, True])
    env = Calculator()
    env.reset(p)
    obs = env.step("<calc>12345+678</calc>")
    assert tok.decode(ids[0][attn[0].bool()].tolist(), skip_special_tokens=True) == \
        "12345+678=<calc>12345+678</calc>" + obs.text + "13023"
    assert tok.decode(ids[0][mask[0]].tolist(), skip_special_tokens=True) == "<calc>12345+678</calc>13023"
    assert tok.decode(ids[1][mask[1]].tolist(), skip_special_tokens=True) == "13023"  # answered at once
    assert ids[0][mask[0]].tolist()[-1] == 2 and ids[1][mask[1]].tolist()[-1] == 2  # and EOS


def test_the_tool_task_measures_episodes_that_call_and_episodes_left_to_choose():
    """tool_success plays greedy episodes with the calculator; forced to call, a policy that never calls is
    measured on its copying instead. A policy that copies perfectly but never calls: 0 left to choose, 1 forced."""
    import torch

    from rlhf.data.arithmetic import Problem
    from rlhf.data.tokenizer import build_tokenizer
    from rlhf.tiny import TOOL_WORDS, tool_success

    tok = build_tokenizer(32, words=TOOL_WORDS)

    class Copier(torch.nn.Module):
        """Writes what the calculator episode needs, token by token, except that it never opens a call."""

        def __init__(self):
            super().__init__()
            self.config = CFG

        def forward(self, ids, mask):
            out = torch.full((ids.shape[0], ids.shape[1], 32), -1e9)
            for i, row in enumerate(ids.tolist()):
                text = tok.decode([t for t, m in zip(row, mask[i].tolist()) if m], skip_special_tokens=True)
                prompt, _, rest = text.partition("=")
                a, b = (int(x) for x in prompt.split("+"))
                if rest == "":
                    nxt = tok.token_to_id("9")  # a wrong direct answer
                elif rest.startswith("<calc>") and "</calc>" not in rest:
                    call = f"{a}+{b}</calc>"
                    done = rest[len("<calc>"):]
                    nxt = tok.token_to_id("</calc>") if call[len(done):].startswith("</calc>") else \
                        tok.token_to_id(call[len(done)])
                elif "</result>" in rest:
                    ans, got = str(a + b), rest.split("</result>")[1]
                    nxt = tok.token_to_id(ans[len(got)]) if len(got) < len(ans) else 2
                else:
                    nxt = 2
                out[i, -1, nxt] = 0.0
            return out

    problems = [Problem("123+45=", "168"), Problem("9+9=", "18")]
    assert tool_success(Copier(), tok, problems) == 0.0
    assert tool_success(Copier(), tok, problems, force_call=True) == 1.0
