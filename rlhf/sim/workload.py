"""What the simulator prices, from shapes alone: a model's parameter groups, FLOPs per token and KV-cache
bytes (`ModelCost`, read once from the canonical parameter table), and one RL step's work (`Workload`,
from a run config). Pure."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from rlhf.model.shapes import kv_per_token_layer, param_shapes
from rlhf.sharding.trainer import Split, frozen_by_name, grad_reduced_over_stage, split_of
from rlhf.schema import Attention, ModelConfig, RewardKind, RunConfig
from weight_sync.plan import DTYPE_BYTES


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters besides its routed experts, by how a rank of tp holds them (the trainer's
    declared splits, `rlhf.sharding.trainer`; the engines split the same tensors the same way)."""

    split: int = 0  # split over tp: q/o projections, MLA's q_b/kv_b, dense and shared-expert MLPs
    kv: int = 0  # GQA's k/v projections: by KV head over tp, one head group's copy per rank past the KV heads
    replicated: int = 0  # whole on every TP rank, gradients over dp: the layer norms (MTP's eh_proj and norms)
    stage: int = 0  # whole on every TP rank, gradients over the stage: router, q/k norms, MLA's latent projections
    frozen: int = 0  # whole, never stepped: the sigmoid router's correction bias

    @property
    def total(self) -> int:
        return self.split + self.kv + self.replicated + self.stage + self.frozen

    def on_rank(self, tp: int, kv_heads: int) -> float:
        """Elements one rank of tp holds."""
        return self.split / tp + self.kv / min(tp, max(1, kv_heads)) + self.replicated + self.stage + self.frozen

    def add(self, name: str, n: int) -> "LayerParams":
        split = split_of(name)
        kind = ("split" if split in (Split.tp_rows, Split.tp_cols) else "kv" if split is Split.tp_kv_rows
                else "frozen" if frozen_by_name(name)
                else "stage" if grad_reduced_over_stage(name) else "replicated")
        return replace(self, **{kind: getattr(self, kind) + n})


@dataclass(frozen=True)
class ModelCost:
    """Parameter groups and per-token costs of a model shape (MTP modules excluded: RL does not run them)."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    vocab: int
    heads: int
    num_experts: int
    top_k: int
    embed: int  # embedding parameters (a lookup: no FLOPs)
    head: int  # LM head parameters (0 when tied)
    layer_dense: int  # attention, norms, routers, dense and shared MLPs of all layers (split over tp)
    expert: int  # one routed expert's parameters
    attn_width: int  # per layer, per context position: query-key and attention-value width (FLOPs / 2)
    kv_per_token: int  # KV-cache elements per token per layer (MLA: the compressed latent + rope key)
    act_per_token_layer: int  # activation elements a layer keeps per token for backward (no recompute)
    # memory only (`rlhf.sim.memory`): how ranks hold the parameters, MTP modules included
    kv_heads: int = 1
    dense_layers: int = 0  # the first layers, with a dense MLP (first_k_dense_layers)
    dense_layer: LayerParams = LayerParams()  # one of them
    moe_layer: LayerParams = LayerParams()  # one MoE layer, routed experts aside
    mtp_layers: int = 0  # MTP modules (held by the trainer's last stage, frozen; not by the engines)
    mtp_layer: LayerParams = LayerParams()  # one of them, its routed experts aside
    final_norm: int = 0

    @property
    def total(self) -> int:
        return self.embed + self.head + self.layer_dense + self.moe_layers * self.num_experts * self.expert

    @property
    def expert_total(self) -> int:
        return self.moe_layers * self.num_experts * self.expert

    @property
    def active(self) -> int:
        """Matmul parameters one token runs through (its top-k experts, the LM head; not the embedding)."""
        return self.head + self.layer_dense + self.moe_layers * self.top_k * self.expert

    def forward_flops(self, tokens: float, context: float) -> float:
        """FLOPs of a forward over `tokens` tokens that each attend to `context` positions on average."""
        return 2.0 * tokens * (self.active + self.layers * self.attn_width * context)


@lru_cache(maxsize=32)
def model_cost(m: ModelConfig) -> ModelCost:
    shapes = param_shapes(m)
    first_mtp = m.num_hidden_layers
    layer_dense = expert_one = 0
    # one layer of each kind, by how ranks hold its tensors: the first dense, the first MoE, the first MTP
    kinds = {0: LayerParams(), m.first_k_dense_layers: LayerParams(), first_mtp: LayerParams()}
    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer in kinds and ".mlp.experts." not in name:
            kinds[layer] = kinds[layer].add(name, n)
        if layer is not None and layer >= first_mtp:
            continue  # MTP module
        if ".mlp.experts." in name:
            if ".mlp.experts.0." in name and name.startswith("model.layers.") and int(name.split(".")[2]) == \
                    m.first_k_dense_layers:
                expert_one += n
        elif name.startswith("model.layers."):
            layer_dense += n
    H, N = m.hidden_size, m.num_attention_heads
    kv = kv_per_token_layer(m)
    if m.attention is Attention.mla:
        a = m.mla
        attn_width = N * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
        qkv = N * (a.qk_nope_head_dim + a.qk_rope_head_dim) + a.kv_lora_rank + N * (a.qk_nope_head_dim + a.v_head_dim)
    else:
        attn_width = 2 * N * m.head_dim
        qkv = (N + 2 * m.num_key_value_heads) * m.head_dim
    moe_layers = m.num_hidden_layers - m.first_k_dense_layers
    shared = m.num_shared_experts * m.shared_expert_intermediate_size
    # kept for backward per token and layer: the two norms' inputs and outputs, q/k/v, the attention output,
    # and per routed copy the expert input, gate, up and activation (the shared expert likewise)
    act = 4 * H + qkv + N * m.head_dim + m.num_experts_per_tok * (H + 3 * m.moe_intermediate_size) + 3 * shared
    return ModelCost(name=m.name, layers=m.num_hidden_layers, moe_layers=moe_layers, hidden=H, vocab=m.vocab_size,
                     heads=N, num_experts=m.num_experts, top_k=m.num_experts_per_tok,
                     embed=m.vocab_size * H, head=0 if m.tie_word_embeddings else m.vocab_size * H,
                     layer_dense=layer_dense, expert=expert_one, attn_width=attn_width, kv_per_token=kv,
                     act_per_token_layer=act, kv_heads=m.num_key_value_heads, dense_layers=m.first_k_dense_layers,
                     dense_layer=kinds[0] if m.first_k_dense_layers else LayerParams(),
                     moe_layer=kinds[m.first_k_dense_layers] if moe_layers else LayerParams(),
                     mtp_layers=m.num_mtp_layers, mtp_layer=kinds[first_mtp] if m.num_mtp_layers else LayerParams(),
                     final_norm=shapes["model.norm.weight"][0])


def attention_quadratic(m: ModelConfig) -> float:
    """The attention term of a sample's predicted cost (`rlhf.micro_batches.sample_cost`), per squared token, in units
    of one token's linear work: a forward over a sequence of L tokens (each attending to L / 2 positions on
    average) costs 2 L active + L^2 layers attn_width FLOPs (`ModelCost.forward_flops`), that is
    2 active (L + q L^2) with q = layers attn_width / (2 active)."""
    c = model_cost(m)
    return c.layers * c.attn_width / (2.0 * c.active)


@dataclass(frozen=True)
class Workload:
    """One step's work, from a run config; the lengths may be given (measured) instead of the limits."""

    prompts: int  # prompts generated per step (gen_prompts_per_step when dynamic sampling draws more)
    train_prompts: int  # prompts trained on per step
    group: int
    prompt_tokens: float  # mean tokens of a prompt
    response_tokens: float  # mean generated tokens of a sample
    max_new_tokens: int
    mini_batch_size: int
    epochs: int
    reference: bool  # a reference forward (kl_coef > 0)
    on_policy: bool  # no separate old-logprob pass
    reward_model: bool
    reward_workers: int
    train_bytes: int  # parameter dtype of the trainer
    rollout_bytes: int
    # rollout.quantization: bytes per element of the engines' quantized weights (fp8_block: 1 + a 4-byte scale per
    # 128 x 128 block); 0: unquantized, every weight `rollout_bytes`. Embedding and head stay `rollout_bytes`.
    train_dtype: str  # what the trainer's matmuls compute in (trainer.compute_dtype, else the parameters')
    rollout_dtype: str
    max_num_seqs: int  # per engine (0: vLLM's default, 256 per tp rank)
    kv_cache_gib: float  # cpu engines: the KV cache each engine rank reserves
    gpu_memory_utilization: float
    expert_load_skew: float = 1.0  # busiest expert rank's load over the mean (1: uniform routing)
    reward_sample_seconds: float = 0.0  # a verifier's measured seconds per sample (a code sandbox, a judge); 0: modelled
    streamed: bool = False  # rollout.stream_groups: each group scored as its engine finishes it
    rollout_quant_bytes: float = 0.0  # see rollout_bytes
    rollout_quantization: str = "none"  # rollout.quantization (how decode reads them: Hardware.decode_weight_bytes)

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    @property
    def train_samples(self) -> int:
        return self.train_prompts * self.group

    @property
    def generated_tokens(self) -> float:
        return self.samples * self.response_tokens

    @property
    def sequence(self) -> float:
        return self.prompt_tokens + self.response_tokens

    @property
    def mini_batches(self) -> int:
        return max(1, -(-self.train_samples // self.mini_batch_size))


def workload(cfg: RunConfig, prompt_tokens: float | None = None, response_tokens: float | None = None,
             expert_load_skew: float = 1.0, reward_sample_seconds: float = 0.0) -> Workload:
    """The step of `cfg`. Without measured lengths a prompt counts `data.max_prompt_tokens` and a sample runs
    to `rollout.max_new_tokens` (an upper bound: answers that stop early take less)."""
    d, a, r, t = cfg.data, cfg.algorithm, cfg.rollout, cfg.trainer
    train_samples = d.prompts_per_step * a.group_size
    mini_batches = max(1, -(-train_samples // t.mini_batch_size))
    return Workload(prompts=d.gen_prompts_per_step or d.prompts_per_step, train_prompts=d.prompts_per_step,
                    group=a.group_size,
                    prompt_tokens=float(d.max_prompt_tokens if prompt_tokens is None else prompt_tokens),
                    response_tokens=float(r.max_new_tokens if response_tokens is None else response_tokens),
                    max_new_tokens=r.max_new_tokens, mini_batch_size=t.mini_batch_size, epochs=t.epochs,
                    reference=a.kl_coef > 0, on_policy=a.on_policy(t.epochs, mini_batches),
                    reward_model=cfg.reward.kind is RewardKind.model, reward_workers=cfg.reward.workers,
                    train_bytes=DTYPE_BYTES[cfg.model.dtype.value], rollout_bytes=DTYPE_BYTES[r.dtype.value],
                    train_dtype=(cfg.trainer.compute_dtype or cfg.model.dtype).value, rollout_dtype=r.dtype.value,
                    max_num_seqs=r.max_num_seqs,
                    kv_cache_gib=float(r.cpu_kv_cache_gib), gpu_memory_utilization=r.gpu_memory_utilization,
                    expert_load_skew=expert_load_skew, reward_sample_seconds=reward_sample_seconds,
                    streamed=r.stream_groups,
                    rollout_quant_bytes=quant_bytes(r.quantization.value, cfg.model.hidden_size),
                    rollout_quantization=r.quantization.value)


def quantized(w: Workload, quantization: str, row: int) -> Workload:
    """`w` with its engines' weights in `quantization` (the search tries each format the hardware serves; `row`:
    the model's hidden size)."""
    return replace(w, rollout_quantization=quantization, rollout_quant_bytes=quant_bytes(quantization, row))


def quant_bytes(quantization: str, row: int) -> float:
    """Bytes per element of a quantized engine weight (0: not quantized): fp8 values and one fp32 scale per
    128 x 128 block, or int8 values and one fp32 scale a row (`weight_sync.quant`; `row`: a typical row's length,
    the model's hidden size)."""
    if quantization == "none":
        return 0.0
    return 1.0 + 4.0 / row if quantization == "int8_channel" else 1.0 + 4.0 / 128 ** 2
