"""Bad input, fuzzed: run YAML, prompt files and model directories. Each gets one clear error (ConfigError or
DatasetError) naming the key, file or line, raised by what a run checks before any actor starts
(`RunInputs.prepare`), or a counted skip where data.skip_bad_rows says so; never a traceback from deep inside."""

import json
import string
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhf.config import ConfigError, load_model_config, load_run_config
from rlhf.data.arithmetic import make_problems, write_jsonl
from rlhf.data.prompts import DatasetError, fit_context, load_prompts
from rlhf.data.tokenizer import build_tokenizer, save_tokenizer
from rlhf.driver.run import RunInputs
from rlhf.model.hf_io import SINGLE_FILE, save_pretrained
from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM
from rlhf.schema import DeviceType, DType

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A tiny policy directory with random weights and the task's prompt files."""
    d = tmp_path_factory.mktemp("policy")
    cfg = load_model_config(CONFIGS / "model" / "qwen3_moe_tiny.yaml")
    m = Qwen3MoeForCausalLM(cfg)
    m.init_weights(seed=0)
    save_pretrained(m, d)
    save_tokenizer(build_tokenizer(cfg.vocab_size), d)
    write_jsonl(make_problems(64, seed=1), d / "train.jsonl")
    write_jsonl(make_problems(16, seed=2), d / "heldout.jsonl")
    return d


def _base(policy: Path, out: Path) -> dict:
    """configs/tiny_cpu.yaml as a dict, its files pointed at the fixture and `out`."""
    raw = yaml.safe_load((CONFIGS / "tiny_cpu.yaml").read_text())
    raw["defaults"] = {k: str(CONFIGS / v) for k, v in raw["defaults"].items()}
    raw["model"]["path"] = str(policy)
    raw["data"]["train_files"], raw["data"]["heldout_files"] = [str(policy / "train.jsonl")], [str(policy / "heldout.jsonl")]
    raw["output_dir"] = raw["tracking"]["dir"] = str(out)
    raw["checkpoint"]["dir"] = str(out / "ckpt")
    return raw


def _prepare(raw: dict, path: Path):
    path.write_text(yaml.safe_dump(raw))
    cfg = load_run_config(path)
    return RunInputs.prepare(cfg, log=lambda m: None)


def test_the_fixture_run_prepares(policy, tmp_path):
    inputs = _prepare(_base(policy, tmp_path / "out"), tmp_path / "run.yaml")
    assert len(inputs.sampler.rows) == 64 and len(inputs.heldout) == 16


# keys a user edits, and values of the wrong type, sign or size
KEYS = ["seed", "steps", "eval_every", "data.prompts_per_step", "data.gen_prompts_per_step", "data.shuffle",
        "algorithm.group_size", "algorithm.estimator", "algorithm.clip_eps_low", "algorithm.kl_coef", "algorithm.max_draws",
        "algorithm.fail_short_batch",
        "rollout.num_engines", "rollout.tp", "rollout.ep", "rollout.max_new_tokens", "rollout.temperature",
        "rollout.dtype", "trainer.dp", "trainer.ep", "trainer.tp", "trainer.pp", "trainer.lr", "trainer.zero_stage",
        "trainer.mini_batch_size", "trainer.micro_batch_tokens", "trainer.recompute", "trainer.collective_timeout_s",
        "placement.devices_per_node", "placement.nodes", "placement.trainer.devices", "placement.rollout.devices",
        "checkpoint.every_steps", "checkpoint.resume", "model.hidden_size", "model.num_experts", "model.vocab_size",
        "model.max_position_embeddings", "data.train_files", "data.prompt_key", "data.max_prompt_tokens",
        "data.skip_bad_rows", "reward.kind"]
VALUES = st.sampled_from([-1, 0, 1, 3, 7, 1000, 2**40, 0.5, -0.5, 1e30, "abc", "", "0-99", True, None, [], [1, 2],
                          {"x": 1}, "/nonexistent/file.jsonl", ["/nonexistent/a.jsonl"]])


def _set(raw: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        raw = raw.setdefault(p, {})
    raw[leaf] = value


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3),
       st.sampled_from(["", "unknown_top", "trainer.unknown", "rollout.tpp"]))
def test_fuzzed_run_yaml_is_accepted_or_refused_with_a_clear_error(policy, tmp_path, edits, unknown):
    raw = _base(policy, tmp_path / "out")
    for key, value in edits:
        _set(raw, key, value)
    if unknown:
        _set(raw, unknown, 1)
    try:
        _prepare(raw, tmp_path / "run.yaml")
    except (ConfigError, DatasetError) as e:
        msg = str(e)
        named = [k for k, _ in edits] + ([unknown] if unknown else [])
        assert any(k.split(".")[-1] in msg for k in named) or "/nonexistent/" in msg, msg
        assert "Traceback" not in msg
    else:
        assert not unknown  # an unknown key never passes silently


GOOD = st.builds(lambda a, b: json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n",
                 st.integers(0, 999), st.integers(0, 999))
BAD = st.sampled_from([b"{not json\n", b"[1, 2]\n", b'{"prompt": "1+1="}\n', b'{"prompt": "", "answer": "1"}\n',
                       b'{"prompt": 5, "answer": "1"}\n', b'{"prompt": "1+1=", "answer": null}\n',
                       b'{"prompt": "\xff\xfe1+1=", "answer": "2"}\n', b"\x80abc\n"])
LONG = st.just(json.dumps({"prompt": "1" * 200 + "+1=", "answer": "2"}) + "\n")  # past the tiny model's 128


@FUZZ
@given(st.lists(st.one_of(GOOD.map(lambda t: ("good", t.encode())), BAD.map(lambda b: ("bad", b)),
                          LONG.map(lambda t: ("long", t.encode())), st.just(("blank", b"\n"))), max_size=12),
       st.booleans())
def test_fuzzed_prompt_files_load_or_name_the_bad_line(tmp_path, lines, skip):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"".join(line for _, line in lines))
    tok = build_tokenizer(32)
    where = {kind: [i for i, (k, _) in enumerate(lines, 1) if k == kind] for kind in ("good", "bad", "long")}
    try:
        rows = fit_context(load_prompts([path], skip_bad_rows=skip), lambda p: len(tok.encode(p).ids), 122,
                           "the context less the answer", skip)
    except DatasetError as e:
        msg = str(e)
        if skip or not (where["bad"] or where["long"]):
            assert not where["good"] and ("no usable rows" in msg or "no prompt fits" in msg), msg
        else:  # the first malformed line, else the first too long
            first = where["bad"][0] if where["bad"] else where["long"][0]
            assert f"{path}:line {first}:" in msg or f"{path}:{first}:" in msg, msg
            assert "data.skip_bad_rows=true" in msg
    else:
        assert [int(r.source.rsplit(":", 1)[1]) for r in rows.rows] == where["good"]
        assert rows.skipped == len(where["bad"]) + len(where["long"]) and (skip or rows.skipped == 0)


def test_prompts_longer_than_the_context_are_refused_before_anything_starts(policy, tmp_path):
    raw = _base(policy, tmp_path / "out")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "1" * 125 + "+1=", "answer": "2"}) + "\n")
    raw["data"]["heldout_files"] = [str(long)]
    raw["data"]["max_prompt_tokens"] = 1000
    with pytest.raises(DatasetError, match=f"data.heldout_files: {long}:1: the prompt is 129 tokens, more than 122 "
                                           r"\(model.max_position_embeddings=128 less rollout.max_new_tokens=6\)"):
        _prepare(raw, tmp_path / "run.yaml")
    raw["data"]["max_prompt_tokens"] = 20
    with pytest.raises(DatasetError, match=r"the prompt is 129 tokens, more than 20 \(data.max_prompt_tokens\)"):
        _prepare(raw, tmp_path / "run.yaml")
    raw["data"]["skip_bad_rows"] = True
    with pytest.raises(DatasetError, match=r"data.heldout_files: no prompt fits in 20 tokens"):
        _prepare(raw, tmp_path / "run.yaml")


def _model_cases(d: Path):
    """(what is broken, how to break a copy of the policy directory `d`, what the error names)."""
    weights = d / SINGLE_FILE
    return {
        "no weights": (lambda: weights.unlink(), "no model.safetensors"),
        "truncated weights": (lambda: weights.write_bytes(weights.read_bytes()[:-1000]), "not a whole safetensors file"),
        "weights of another model": (lambda: torch.save({}, weights), "not a whole safetensors file"),
        "a tensor missing": (lambda: _drop_tensor(weights), "missing ['lm_head.weight']"),
        "config another shape": (lambda: _edit_json(d / "config.json", hidden_size=64), "hidden_size"),
        "config not JSON": (lambda: (d / "config.json").write_text("{"), "config.json cannot be read"),
        "config missing a key": (lambda: _edit_json(d / "config.json", drop="num_hidden_layers"),
                                 "config.json cannot be read"),
        "tokenizer too large": (lambda: save_tokenizer(build_tokenizer(66, string.printable[:62]), d),
                                "the tokenizer has 66 tokens, more than the model's vocab_size 32"),
        "no tokenizer": (lambda: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
        "tokenizer not JSON": (lambda: (d / "tokenizer.json").write_text("x"), "tokenizer.json does not load"),
        "index naming a missing file": (lambda: (weights.unlink(), (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"lm_head.weight": "model-00001.safetensors"}}))),
            "names ['model-00001.safetensors']"),
    }


def _drop_tensor(path: Path):
    from safetensors.torch import load_file, save_file
    t = load_file(path)
    del t["lm_head.weight"]
    save_file(t, path)


def _edit_json(path: Path, drop: str = "", **kw):
    d = json.loads(path.read_text())
    d.pop(drop, None)
    path.write_text(json.dumps(d | kw))


@pytest.mark.parametrize("case", list(_model_cases(Path("."))))
def test_broken_model_directories_are_refused_naming_the_file(policy, tmp_path, case):
    import shutil

    d = tmp_path / "policy"
    shutil.copytree(policy, d)
    breaks, message = _model_cases(d)[case]
    breaks()
    raw = _base(d, tmp_path / "out")
    with pytest.raises(ConfigError, match="model.path") as e:
        _prepare(raw, tmp_path / "run.yaml")
    assert message in str(e.value), str(e.value)


def test_code_reward_refuses_answers_that_are_no_tests_before_any_actor_starts(policy, tmp_path):
    raw = _base(policy, tmp_path / "out")
    raw.setdefault("reward", {})["kind"] = "code"
    with pytest.raises(DatasetError, match=r"data.train_files: .*train.jsonl:1: the answer is not tests for "
                                           r"reward.kind=code: the tests check nothing"):
        _prepare(raw, tmp_path / "run.yaml")
    rows = [{"prompt": f"{a}+{b}=", "answer": f"assert f({a}, {b}) == {a + b}"} for a, b in ((1, 2), (3, 4), (5, 6))]
    rows.append({"prompt": "9+9=", "answer": "assert ("})  # not Python
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw["data"]["train_files"], raw["data"]["heldout_files"] = [str(tmp_path / "train.jsonl")], [str(tmp_path / "heldout.jsonl")]
    with pytest.raises(DatasetError, match=r"train.jsonl:4: the answer is not tests .*not valid Python"):
        _prepare(raw, tmp_path / "run.yaml")
    raw["data"]["skip_bad_rows"] = True
    inputs = _prepare(raw, tmp_path / "run2.yaml")
    assert len(inputs.sampler.rows) == 3 and len(inputs.heldout) == 3


def test_code_reward_without_the_box_is_refused_before_any_actor_starts(policy, tmp_path, monkeypatch):
    """`reward.sandbox.isolation: kernel` (the default) where the kernel cannot make the box: refused, saying which
    setting to change; `process` chosen explicitly runs, with a warning."""
    from rlhf.data import sandbox_box

    rows = [{"prompt": f"{a}+{b}=", "answer": f"assert f({a}, {b}) == {a + b}"} for a, b in ((1, 2), (3, 4))]
    for name in ("train.jsonl", "heldout.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = _base(policy, tmp_path / "out")
    raw.setdefault("reward", {})["kind"] = "code"
    raw["data"]["train_files"], raw["data"]["heldout_files"] = [str(tmp_path / "train.jsonl")], [str(tmp_path / "heldout.jsonl")]
    monkeypatch.setattr(sandbox_box, "box_problem", lambda: "the kernel refused the box (unshare: Operation not permitted)")
    with pytest.raises(ConfigError, match=r"reward.sandbox.isolation=kernel: the kernel refused the box .*set "
                                          r"reward.sandbox.isolation=process"):
        _prepare(raw, tmp_path / "run.yaml")
    raw["reward"]["sandbox"] = {"isolation": "process"}
    said = []
    path = tmp_path / "run2.yaml"
    path.write_text(yaml.safe_dump(raw))
    RunInputs.prepare(load_run_config(path), log=said.append)
    assert any("reward.sandbox.isolation=process" in s and "without the box" in s for s in said)


def test_a_bf16_trainer_on_a_cpu_without_bf16_matmuls_is_refused_before_any_actor_starts(policy, tmp_path, monkeypatch):
    """On a cpu whose torch has no fast bf16 matmul (x86 without AVX-512 or AMX: its reference loop, about 50x slower
    than fp32), a bf16 trainer is refused before any actor starts and by each rank on its own machine, naming the
    setting to change; fp32 runs, and trainer.allow_slow_cpu_bf16=true runs bf16 anyway."""
    from actors.trainer_worker import PolicyWorker
    from rlhf import cpu_matmul

    monkeypatch.setattr(cpu_matmul, "half_matmul_fast", lambda dtype: dtype.value == "float32")
    raw = _base(policy, tmp_path / "out")
    raw.setdefault("trainer", {})["compute_dtype"] = "bfloat16"
    with pytest.raises(ConfigError, match=r"trainer.compute_dtype = bfloat16: this cpu has no bfloat16 matmul .*about "
                                          r"50x slower than fp32.*Set trainer.compute_dtype=float32 .*"
                                          r"trainer.allow_slow_cpu_bf16=true"):
        _prepare(raw, tmp_path / "run.yaml")
    cfg = load_run_config(tmp_path / "run.yaml", [f"output_dir={tmp_path / 'out2'}"])
    with pytest.raises(ConfigError, match="trainer.compute_dtype = bfloat16: this cpu"):  # a rank on its own machine
        PolicyWorker(cfg.model, cfg.trainer, cfg.placement.device_type, 0, str(policy))
    raw["trainer"]["allow_slow_cpu_bf16"] = True
    assert len(_prepare(raw, tmp_path / "run.yaml").sampler.rows) == 64
    del raw["trainer"]["allow_slow_cpu_bf16"], raw["trainer"]["compute_dtype"]
    assert len(_prepare(raw, tmp_path / "run.yaml").sampler.rows) == 64  # fp32, the tiny configs' dtype
    # a model stored in bf16 trains in bf16: the fix names both keys
    assert "Set model.dtype=float32 and trainer.compute_dtype=float32" in cpu_matmul.compute_dtype_problem(
        replace(cfg.model, dtype=DType.bfloat16), replace(cfg.trainer, compute_dtype=None), DeviceType.cpu)
    # other devices are not this cpu's business
    assert cpu_matmul.compute_dtype_problem(cfg.model, cfg.trainer, DeviceType.cuda) is None


def test_torch_says_whether_its_half_matmuls_are_fast_here():
    """`half_matmul_fast` asks torch's own check, which its matmul dispatch makes: True for fp32 always, for bf16
    exactly where oneDNN takes torch's bf16 matmuls (the AVX-512 / AMX machines here; False on an AVX2-only one)."""
    from rlhf.cpu_matmul import half_matmul_fast

    assert half_matmul_fast(DType.float32)
    assert half_matmul_fast(DType.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
