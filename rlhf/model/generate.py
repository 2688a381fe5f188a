"""Greedy decoding with our torch model, for evaluation and parity checks (rollouts use vLLM).

Prompts are left-padded into one batch; each step re-runs the full forward (no KV cache: prompts
here are tens of tokens). Generation of a row stops at its first EOS, which is not returned, or at its first
token of `stop_ids` (a tool call's end), which is.
"""

from __future__ import annotations

from typing import Collection, Sequence

import torch

from rlhf.model.qwen3_moe import Qwen3MoeForCausalLM


@torch.no_grad()
def greedy_generate(
    model: Qwen3MoeForCausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int = 256,
    stop_ids: Collection[int] = (),
) -> list[list[int]]:
    """For each prompt (token ids, BOS included), the greedily generated ids up to EOS or the limit."""
    cfg = model.config
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long)
    out: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), cfg.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(list(p))
            mask[i, width - len(p):] = 1
        done = torch.zeros(len(chunk), dtype=torch.bool)
        new = []
        for _ in range(max_new_tokens):
            nxt = model(ids, mask)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, cfg.pad_token_id), nxt)
            new.append(nxt)
            done |= (nxt == cfg.eos_token_id) | torch.isin(nxt, stops)
            ids = torch.cat([ids, nxt[:, None]], 1)
            mask = torch.cat([mask, (~done | (nxt == cfg.eos_token_id)).long()[:, None]], 1)
            if done.all():
                break
        gen = torch.stack(new, 1).tolist() if new else [[] for _ in chunk]
        for row in gen:
            end = next((i for i, t in enumerate(row) if t == cfg.eos_token_id or t in stop_ids), len(row))
            out.append(row[: end + (end < len(row) and row[end] != cfg.eos_token_id)])
    return out
