"""Advantages from scalar rewards. Pure.

Legend: P prompts, G samples per prompt (a group), B = P * G samples, T response tokens.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards_PG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each sample's reward minus its group's mean, divided by the group's std when asked
    (Dr. GRPO leaves the std out). Groups with equal rewards get advantage 0."""
    centred = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards_PG.std(dim=1, keepdim=True, unbiased=True) + eps)


def reinforce_pp_advantages(rewards_PG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with baseline: subtract the group mean, then normalise over the whole batch."""
    centred = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    return (centred - centred.mean()) / (centred.std() + eps)


def nonzero_variance_groups(rewards_PG: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: which groups carry signal (not all rewards equal). [P] bool."""
    return (rewards_PG.max(dim=1).values - rewards_PG.min(dim=1).values) > 0


def overlong_penalty(lengths_B: torch.Tensor, max_tokens: int, buffer_tokens: int, penalty: float) -> torch.Tensor:
    """DAPO soft overlong punishment: 0 up to max - buffer, then linearly down to -penalty at max."""
    if buffer_tokens <= 0:
        return torch.zeros_like(lengths_B, dtype=torch.float32)
    over = (lengths_B.float() - (max_tokens - buffer_tokens)).clamp(min=0) / buffer_tokens
    return -penalty * over.clamp(max=1.0)
