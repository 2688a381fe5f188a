"""Multi-head latent attention (DeepSeek-V2/V3, Pangu Ultra MoE) and its rotary embedding, in plain torch.

Parameter names are transformers' `DeepseekV3Attention` ones, which released checkpoints and vLLM use:
queries through a low-rank pair (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`, or one `q_proj` when
`q_lora_rank` is 0); keys and values from a shared latent (`kv_a_proj_with_mqa` gives the latent and one
rotary key shared by all heads, `kv_a_layernorm`, then `kv_b_proj` expands the latent per head into the
non-rotary key part and the value). The rotary part of each head is laid out in interleaved pairs
(x0, x1), (x2, x3), ... as DeepSeek's checkpoints are (`rope_interleave: true`; vLLM's `is_neox_style=False`).

YaRN (`ModelConfig.rope_scaling`) stretches the rotary frequencies and scales cos/sin by an attention factor;
with `mscale_all_dim` the softmax scale also grows, as DeepSeek-V3 configures it.

Legend: B batch, T tokens, H hidden, N heads, R rotary dims per head, C latent rank, Q query rank.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rlhf.model.layers import RMSNorm, attention
from rlhf.schema import ModelConfig, RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], factor on cos and sin). YaRN: frequencies whose wavelength fits the
    original context many times (beta_fast rotations) stay, those below beta_slow rotations are divided by
    `factor`, a linear ramp in between (its ends rounded outwards)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    inv_freq = 1.0 / theta ** exponents
    if scaling is None or scaling.factor <= 1:
        return inv_freq, 1.0

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_of(scaling.beta_slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
    if scaling.mscale and scaling.mscale_all_dim:
        factor = _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    else:
        factor = _yarn_mscale(scaling.factor)
    return inv_freq, factor


def softmax_scale(cfg: ModelConfig) -> float:
    m = cfg.mla
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.factor > 1 and s.mscale_all_dim:
        scale *= _yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def mla_cos_sin(position_ids_BT: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos and sin [B, T, R / 2] of each rotary pair's angle, the YaRN factor applied."""
    inv_freq, factor = rope_frequencies(cfg.mla.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = position_ids_BT[..., None].float() * inv_freq.to(position_ids_BT.device)
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


def apply_rope_interleaved(x_BNTR: torch.Tensor, cos_BTr: torch.Tensor, sin_BTr: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by angle i; the result holds the rotated evens, then the odds
    (the layout transformers and vLLM produce, so attention scores agree)."""
    cos, sin = cos_BTr[:, None], sin_BTr[:, None]
    even, odd = x_BNTR[..., 0::2], x_BNTR[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m, H, N = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
        self.n_heads, self.nope, self.rope, self.v_dim, self.rank = (
            N, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank)
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(H, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, N * qk, bias=False)
        else:
            self.q_proj = nn.Linear(H, N * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, N * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(N * m.v_head_dim, H, bias=False)
        self.scale = softmax_scale(cfg)

    def forward(self, x_BTH, cos, sin, mask_B1TT):
        B, T, _ = x_BTH.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTH))) if hasattr(self, "q_b_proj") else self.q_proj(x_BTH)
        q_nope, q_rot = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        latent, k_rot = self.kv_a_proj_with_mqa(x_BTH).split([self.rank, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        q_rot = apply_rope_interleaved(q_rot, cos, sin)
        k_rot = apply_rope_interleaved(k_rot[:, None], cos, sin).expand(-1, k_nope.shape[1], -1, -1)
        q = torch.cat((q_nope, q_rot), -1)
        k = torch.cat((k_nope, k_rot), -1)
        out = attention(q, k, v, mask_B1TT, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))
