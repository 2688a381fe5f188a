"""reward.kind and reward.model_path are checked together when a run config loads."""

import pytest

from rlhf.config import ConfigError, load_run_config


def _load(tmp_path, *overrides):
    (tmp_path / "run.yaml").write_text("{}")
    return load_run_config(tmp_path / "run.yaml", list(overrides))


def test_model_kind_needs_a_model_path(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.model_path = None: reward.kind = model needs a reward model; set "
                                          r"reward.model_path"):
        _load(tmp_path, "reward.kind=model")


def test_model_path_must_hold_config_and_tokenizer(tmp_path):
    (tmp_path / "rm").mkdir()
    with pytest.raises(ConfigError, match=r"reward.model_path = '.*rm': has no config.json or tokenizer.json"):
        _load(tmp_path, "reward.kind=model", f"reward.model_path={tmp_path / 'rm'}")
    (tmp_path / "rm" / "config.json").write_text("{}")
    (tmp_path / "rm" / "tokenizer.json").write_text("{}")
    assert _load(tmp_path, "reward.kind=model", f"reward.model_path={tmp_path / 'rm'}").reward.model_path


def test_model_path_without_model_kind_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.model_path = '/x': is only read with reward.kind = model "
                                          r"\(kind is math_verify\)"):
        _load(tmp_path, "reward.kind=math_verify", "reward.model_path=/x")


def test_sandbox_limits_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.sandbox.timeout_s = 0.0: must be > 0") as e:
        _load(tmp_path, "reward.kind=code", "reward.sandbox.timeout_s=0", "reward.sandbox.processes=-1")
    assert "reward.sandbox.processes = -1" in str(e.value)
    with pytest.raises(ConfigError, match=r"reward.sandbox.memory_mb = 32: is below what a Python interpreter needs"):
        _load(tmp_path, "reward.kind=code", "reward.sandbox.memory_mb=32")
    cfg = _load(tmp_path, "reward.kind=code", "reward.sandbox.timeout_s=2.5")
    assert cfg.reward.sandbox.timeout_s == 2.5 and cfg.reward.sandbox.processes == 2
    with pytest.raises(ConfigError, match=r"reward.sandbox.compile_timeout_s = 0.0: must be > 0") as e:
        _load(tmp_path, "reward.kind=code", "reward.sandbox.compile_timeout_s=0", "reward.sandbox.cpp_command=' '")
    assert "reward.sandbox.cpp_command = ' ': is empty: give the C++ compiler and its flags" in str(e.value)
    with pytest.raises(ConfigError, match=r"reward.sandbox.cpp_command = .*balance its quotes") as e:
        _load(tmp_path, "reward.kind=code", "reward.sandbox.cpp_command=\"g++ -DX='a\"",
              "reward.sandbox.cpp_precompiled_header=../x.h")
    assert "reward.sandbox.cpp_precompiled_header = '../x.h': is a header as programs include it" in str(e.value)
    with pytest.raises(ConfigError, match=r"cpp_precompiled_header = '/etc/x.h': is a header as programs include it"):
        _load(tmp_path, "reward.kind=code", "reward.sandbox.cpp_precompiled_header=/etc/x.h")
