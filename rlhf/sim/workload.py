"""What the simulator prices, from shapes alone: a model's parameter groups, FLOPs per token and KV-cache
bytes (`ModelCost`, read once from the canonical parameter table), and one RL step's work (`Workload`,
from a run config). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rlhf.model.shapes import param_shapes
from rlhf.schema import Attention, ModelConfig, RewardKind, RunConfig
from weight_sync.plan import DTYPE_BYTES


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
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= first_mtp:
            continue  # MTP module
        n = 1
        for s in shape:
            n *= s
        if ".mlp.experts." in name:
            if ".mlp.experts.0." in name and name.startswith("model.layers.") and int(name.split(".")[2]) == \
                    m.first_k_dense_layers:
                expert_one += n
        elif name.startswith("model.layers."):
            layer_dense += n
    H, N = m.hidden_size, m.num_attention_heads
    if m.attention is Attention.mla:
        a = m.mla
        attn_width = N * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim)
        kv = a.kv_lora_rank + a.qk_rope_head_dim
        qkv = N * (a.qk_nope_head_dim + a.qk_rope_head_dim) + a.kv_lora_rank + N * (a.qk_nope_head_dim + a.v_head_dim)
    else:
        attn_width = 2 * N * m.head_dim
        kv = 2 * m.num_key_value_heads * m.head_dim
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
                     act_per_token_layer=act)


def attention_quadratic(m: ModelConfig) -> float:
    """The attention term of a sample's predicted cost (`rlhf.balance.sample_cost`), per squared token, in units
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
    train_dtype: str
    rollout_dtype: str
    max_num_seqs: int  # per engine (0: vLLM's default, 256 per tp rank)
    kv_cache_gib: float  # cpu engines: the KV cache each engine rank reserves
    gpu_memory_utilization: float
    expert_load_skew: float = 1.0  # busiest expert rank's load over the mean (1: uniform routing)

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
             expert_load_skew: float = 1.0) -> Workload:
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
                    train_dtype=cfg.model.dtype.value, rollout_dtype=r.dtype.value, max_num_seqs=r.max_num_seqs,
                    kv_cache_gib=float(r.cpu_kv_cache_gib), gpu_memory_utilization=r.gpu_memory_utilization,
                    expert_load_skew=expert_load_skew)
