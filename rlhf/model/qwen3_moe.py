"""MoE decoders in plain torch: Qwen3-MoE, architecture-compatible with transformers' Qwen3MoeForCausalLM,
and DeepSeek-V3 / Pangu Ultra MoE (`architecture: pangu_moe`), compatible with DeepseekV3ForCausalLM:
multi-head latent attention (`rlhf.model.mla`), a sigmoid group-limited router with a correction bias,
shared experts, dense-first layers, multi-token-prediction modules carried but not run.

The maths only: no parallelism here (sharding is declared elsewhere and applied to these modules).
Parameter names equal transformers' in-memory names, routed experts included: each MoE layer holds
its experts stacked, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, then up) and
`mlp.experts.down_proj` [E, H, I]. On disk, checkpoints use the per-expert names
(`mlp.experts.{e}.gate_proj.weight`, ...) that released Qwen3-MoE checkpoints and vLLM use;
`rlhf.model.hf_io` converts between the two.

Each forward records, per MoE layer, how many (valid) tokens were routed to each expert
(`router_stats()`), for expert-load metrics, expert placement and the simulator; training forwards
also add them up per optimizer step (`record_loads`), for the sigmoid router's bias update
(`router_bias_update`). A `Routing`
(`rlhf.moe.routing`) given to the forward forces, records or compares each layer's expert choice
(routing replay).

Legend: B batch, T tokens, H hidden, N query heads, K kv heads, D head dim, E experts, k top-k,
I expert FFN size, V vocab.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from rlhf.model.head import head_logprobs
from rlhf.model.experts import grouped_mm_fits, grouped_mm_supported, grouped_swiglu, looped_swiglu
from rlhf.model.layers import (Embedding, RMSNorm, attention, autocast_dtype, cast_once, full_precision_linear,
                               residual)
from rlhf.model.mla import LatentAttention, mla_cos_sin
from rlhf.moe.routing import Routing, observe, route
from rlhf.schema import Architecture, Attention as AttentionKind, ModelConfig, RouterScoring

# bf16 under autocast on cpu: each expert's group of rows is padded with zero rows to a multiple of this. oneDNN runs
# those matmuls and builds a primitive per shape (rlhf.host_memory.small_onednn_cache); with the row counts routing
# gives, nearly every expert and micro-batch would make a new one.
EXPERT_ROWS_MULTIPLE = 64


def rope_cos_sin(position_ids_BT: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids_BT.device) / head_dim))
    freqs = position_ids_BT[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x_BNTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BTD[:, None], sin_BTD[:, None]
    return x_BNTD * cos + _rotate_half(x_BNTD) * sin


class SelfAttention(nn.Module):
    """Grouped-query attention with per-head RMSNorm on q and k (Qwen3)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x_BTH, cos, sin, mask_B1TT):
        B, T, _ = x_BTH.shape
        q = self.q_norm(self.q_proj(x_BTH).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x_BTH).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x_BTH).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v, mask_B1TT, enable_gqa=k.shape[1] != q.shape[1])
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Top-k softmax router; with norm_topk_prob the chosen weights are renormalised to sum to 1."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def scores(self, x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probabilities [S, E], what the top-k ranks: the same probabilities)."""
        probs_SE = torch.softmax(full_precision_linear(x_SH.to(self.weight.dtype), self.weight), dim=-1,
                                 dtype=torch.float)
        return probs_SE, probs_SE

    def forward(self, x_SH: torch.Tensor, forced_Sk: torch.Tensor | None = None):
        """(weights [S, k], experts [S, k], the live top-k [S, k]); rows of `forced_Sk` other than -1 use
        those experts, weighted by the live probabilities (`rlhf.moe.routing.route`)."""
        probs_SE, _ = self.scores(x_SH)
        weights_Sk, experts_Sk, live_Sk = route(probs_SE, self.top_k, forced_Sk)
        if self.norm_topk_prob:
            weights_Sk = weights_Sk / weights_Sk.sum(dim=-1, keepdim=True)
        return weights_Sk.to(x_SH.dtype), experts_Sk, live_Sk


def record_loads(block: nn.Module, chosen: torch.Tensor) -> None:
    """An MoE block's token counts per expert for the experts `chosen` in this forward: `last_tokens_per_expert`,
    and added to `step_tokens_per_expert` when this is a training forward (gradients on, and not activation
    recompute, which reruns the forward inside the backward), so an optimizer step counts each token once."""
    with torch.no_grad():
        counts = torch.bincount(chosen.reshape(-1), minlength=block.num_experts)
    block.last_tokens_per_expert = counts
    if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
        step = block.step_tokens_per_expert
        block.step_tokens_per_expert = counts if step is None else step + counts


def router_bias_update(bias_E: torch.Tensor, loads_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing: after a step, each expert's correction bias moves by `rate`
    toward balance, down when it received more tokens than the mean, up when fewer (unchanged at the mean)."""
    loads = loads_E.double()
    return bias_E + (rate * torch.sign(loads.mean() - loads)).to(bias_E.dtype)


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router: sigmoid scores; the choice adds a per-expert correction bias (a balancing
    term, not trained by gradients) and keeps only the `topk_group` groups of experts whose two best biased
    scores sum highest; the weights are the unbiased scores of the chosen experts, renormalised with
    norm_topk_prob, times routed_scaling_factor. Scores in fp32 whatever the model's dtype."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts), requires_grad=False)

    def scores(self, x_SH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigmoid scores [S, E], what the top-k ranks [S, E]: scores plus bias, -inf outside the best groups)."""
        scores_SE = torch.sigmoid(full_precision_linear(x_SH.float(), self.weight.float()))
        choice_SE = scores_SE + self.e_score_correction_bias.float()
        if self.n_group > 1:
            S, E = choice_SE.shape
            grouped = choice_SE.view(S, self.n_group, E // self.n_group)
            best_SG = grouped.topk(2, dim=-1).values.sum(-1)
            keep_SG = torch.zeros_like(best_SG, dtype=torch.bool).scatter_(
                1, best_SG.topk(self.topk_group, dim=-1).indices, True)
            choice_SE = grouped.masked_fill(~keep_SG[..., None], float("-inf")).view(S, E)
        return scores_SE, choice_SE

    def forward(self, x_SH: torch.Tensor, forced_Sk: torch.Tensor | None = None):
        """As `Router.forward`."""
        scores_SE, choice_SE = self.scores(x_SH)
        weights_Sk, experts_Sk, live_Sk = route(scores_SE, self.top_k, forced_Sk, choice_SE)
        if self.norm_topk_prob:
            weights_Sk = weights_Sk / (weights_Sk.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights_Sk * self.scaling).to(x_SH.dtype), experts_Sk, live_Sk


class Experts(nn.Module):
    """Routed SwiGLU experts stored stacked, so expert parallelism is a split of dim 0."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x_SH, experts_Sk, weights_Sk):
        """Each token's output: the sum over its k chosen experts of weight * SwiGLU expert(x)."""
        k = experts_Sk.shape[1]
        y_Rk = self.forward_rows(x_SH.repeat_interleave(k, dim=0), experts_Sk.reshape(-1))
        return (y_Rk.view(-1, k, x_SH.shape[1]) * weights_Sk[..., None]).sum(1)

    def forward_rows(self, x_RH: torch.Tensor, expert_R: torch.Tensor) -> torch.Tensor:
        """SwiGLU expert `expert_R[r]` (an index into this module's stack) applied to row r: grouped multiplies over
        the whole stack where torch has them for the device and compute dtype, else a loop over experts
        (`rlhf.model.experts`)."""
        if x_RH.shape[0] == 0:
            # No row for these experts (expert parallelism can send a rank none): zeros still tied to the input
            # and the weights, so the backward reaches the all-to-all that brought the rows and every rank of
            # the EP group joins it (with zeros from x_RH.new_zeros the rank skipped it and its peers hung).
            return x_RH * 0 + 0 * (self.gate_up_proj.sum() + self.down_proj.sum())
        device = x_RH.device.type
        gate_up, down = self.gate_up_proj, self.down_proj
        dtype = autocast_dtype(device)
        multiple = EXPERT_ROWS_MULTIPLE if dtype is torch.bfloat16 and device == "cpu" else 1
        compute = dtype or gate_up.dtype
        grouped = grouped_mm_supported(device, compute) and grouped_mm_fits(gate_up, down, compute)
        # On cpu the grouped backward adds the stacks' gradients into the parameters' own (`grouped_swiglu`'s
        # `params`), so the casts there carry no autograd.
        params = (gate_up, down) if grouped and device == "cpu" else None
        if dtype is not None:  # one cast of each stack per step (`casts_kept`), not one per expert and call
            with torch.no_grad() if params else contextlib.nullcontext():
                gate_up, down = cast_once(gate_up, dtype), cast_once(down, dtype)
        if grouped:
            with torch.autocast(device, enabled=False):  # the operands are in the compute dtype already
                return grouped_swiglu(x_RH, expert_R, gate_up, down, multiple, params)
        return looped_swiglu(x_RH, expert_R, gate_up, down, multiple)


class SparseMoE(nn.Module):
    """Routed experts, plus shared experts that every token passes through (DeepSeek-V3: `shared_experts`, one
    SwiGLU MLP of num_shared_experts x shared_expert_intermediate_size)."""

    def __init__(self, cfg: ModelConfig, moe_index: int = 0):
        super().__init__()
        self.gate = GroupLimitedRouter(cfg) if cfg.router_scoring is RouterScoring.sigmoid else Router(cfg)
        self.experts = Experts(cfg)
        if cfg.num_shared_experts:
            self.shared_experts = DenseMLP(cfg.hidden_size, cfg.num_shared_experts * cfg.shared_expert_intermediate_size)
        self.num_experts = cfg.num_experts
        self.moe_index = moe_index  # this block's place among the MoE layers (routes are indexed by it)
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.step_tokens_per_expert: torch.Tensor | None = None  # summed over an optimizer step's forwards

    def forward(self, x_BTH, valid_BT=None, routing: Routing | None = None):
        B, T, H = x_BTH.shape
        x_SH = x_BTH.reshape(-1, H)
        if routing is None:
            weights_Sk, experts_Sk, _ = self.gate(x_SH)
        else:
            i = self.moe_index
            weights_Sk, experts_Sk, live_Sk = self.gate(x_SH, routing.layer(routing.forced_BTLk, i))
            observe(routing, i, live_Sk, routing.layer(routing.engine_BTLk, i))
        record_loads(self, experts_Sk if valid_BT is None else experts_Sk[valid_BT.reshape(-1)])
        y_SH = self.experts(x_SH, experts_Sk, weights_Sk)
        if hasattr(self, "shared_experts"):
            y_SH = y_SH + self.shared_experts(x_SH)
        return y_SH.view(B, T, H)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LatentAttention(cfg) if cfg.attention is AttentionKind.mla else SelfAttention(cfg)
        self.is_moe = layer_idx >= cfg.first_k_dense_layers
        self.mlp = (SparseMoE(cfg, layer_idx - cfg.first_k_dense_layers) if self.is_moe
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, valid_BT, routing=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, valid_BT, routing) if self.is_moe else self.mlp(h))


class MTPLayer(DecoderLayer):
    """A multi-token-prediction module (DeepSeek-V3): it predicts the token after next from the last
    hidden state and the next token's embedding. Carried, not run: loaded, checkpointed, exported and
    synced unchanged, its parameters frozen (nothing here trains or serves speculative decoding)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        H = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(H, cfg.rms_norm_eps), RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.requires_grad_(False)


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        # MTP modules follow the decoder layers, under the names checkpoints give them (model.layers.{L + k});
        # the forward runs the first num_hidden_layers only.
        L = cfg.num_hidden_layers
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(L)] +
                                    [MTPLayer(cfg, L + k) for k in range(cfg.num_mtp_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeDecoder(nn.Module):
    """The decoder (`model.*`) without a head: the LM head and the reward model's score head subclass it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        check_supported(cfg)
        self.config = cfg
        self.model = Qwen3MoeModel(cfg)

    def hidden_states(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [B, T, H]. `attention_mask_BT` (1 = real token) allows left or right padding;
        `routing` forces, records or compares the MoE layers' expert choices."""
        ctx = self.prepare(input_ids_BT, attention_mask_BT, position_ids_BT, routing)
        x = residual(self.model.embed_tokens(input_ids_BT))
        for layer in self.model.layers[: self.config.num_hidden_layers]:
            x = layer(x, *ctx)
        return self.model.norm(x)

    def prepare(self, input_ids_BT, attention_mask_BT=None, position_ids_BT=None, routing=None):
        """What every layer needs besides the hidden states: (cos, sin, attention mask, valid tokens, routing)."""
        cfg = self.config
        B, T = input_ids_BT.shape
        dev = input_ids_BT.device
        causal_TT = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        if attention_mask_BT is None:
            valid_BT = None
            mask = causal_TT[None, None]
            if position_ids_BT is None:
                position_ids_BT = torch.arange(T, device=dev).expand(B, T)
        else:
            valid_BT = attention_mask_BT.bool()
            # A padded query row would have no key to attend to; let it see itself so softmax stays finite.
            mask = (causal_TT[None] & valid_BT[:, None, :]) | torch.eye(T, dtype=torch.bool, device=dev)[None]
            mask = mask[:, None]
            if position_ids_BT is None:
                position_ids_BT = (valid_BT.long().cumsum(-1) - 1).clamp(min=0)
        dtype = autocast_dtype(dev.type) or next(self.parameters()).dtype  # q and k's dtype
        if cfg.attention is AttentionKind.mla:
            cos, sin = mla_cos_sin(position_ids_BT, cfg, dtype)
        else:
            cos, sin = rope_cos_sin(position_ids_BT, cfg.head_dim, cfg.rope_theta, dtype)
        return cos, sin, mask, valid_BT, routing

    def router_stats(self) -> torch.Tensor:
        """Tokens routed to each expert in the last forward: [num MoE layers, E] (int64)."""
        rows = [l.mlp.last_tokens_per_expert for l in self.model.layers[: self.config.num_hidden_layers] if l.is_moe]
        if any(r is None for r in rows):
            raise RuntimeError("router_stats() needs a forward pass first")
        return torch.stack(rows)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02, router_bias_std: float = 0.0) -> None:
        """Deterministic initialisation for a seed: normal(0, std) matrices, unit norms; the sigmoid router's
        correction bias zero, or normal(0, router_bias_std) (tests: a trained router's bias moves the choice)."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * router_bias_std) if router_bias_std else p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


class LMHead(nn.Linear):
    """The output projection. Given the next tokens it returns (logp, entropy) per position instead of
    logits, fused and chunked over tokens (`rlhf.model.head`): what a policy update needs, without the
    [tokens, vocab] tensors. Through `forward`, so modules that wrap it (ZeRO-3's gather) see both uses."""

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None, temperature: float = 1.0):
        if targets is None:
            return super().forward(x)
        return head_logprobs(x, self.weight, targets, temperature)


class Qwen3MoeForCausalLM(Qwen3MoeDecoder):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        position_ids_BT: torch.Tensor | None = None,
        routing: Routing | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V]. `attention_mask_BT` (1 = real token) allows left or right padding."""
        return self.lm_head(self.hidden_states(input_ids_BT, attention_mask_BT, position_ids_BT, routing))


def check_supported(cfg: ModelConfig) -> None:
    """The torch model builds Qwen3-MoE and DeepSeek-V3 (Pangu Ultra MoE) decoders; the schema describes
    mixes of the two (used by planning) that no released checkpoint has."""
    if cfg.architecture is Architecture.qwen3_moe:
        expected = {"attention": AttentionKind.gqa, "router_scoring": RouterScoring.softmax, "num_shared_experts": 0,
                    "num_mtp_layers": 0}
        want = "GQA, softmax router, routed experts only, no MTP"
    else:
        expected = {"attention": AttentionKind.mla, "router_scoring": RouterScoring.sigmoid}
        want = "MLA attention, sigmoid router"
    unsupported = [f"{k}={getattr(getattr(cfg, k), 'value', getattr(cfg, k))}" for k, v in expected.items()
                   if getattr(cfg, k) != v]
    if cfg.architecture is Architecture.pangu_moe:
        if cfg.num_shared_experts and cfg.shared_expert_intermediate_size != cfg.moe_intermediate_size:
            unsupported.append(f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size} "
                               f"(DeepSeek-V3 checkpoints size it as moe_intermediate_size={cfg.moe_intermediate_size})")
    if unsupported:
        raise NotImplementedError(
            f"model {cfg.name!r}: architecture {cfg.architecture.value} is built with {want}; "
            f"{', '.join(unsupported)} can be planned and simulated but not built")
