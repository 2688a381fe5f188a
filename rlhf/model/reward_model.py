"""Reward model: the Qwen3-MoE decoder with a scalar score head, and its HF directories.

Compatible with transformers' `Qwen3MoeForSequenceClassification` with `num_labels=1`: the decoder's
`model.*` tensors (experts per-expert on disk, as `rlhf.model.hf_io` writes them) plus `score.weight`
[1, H]. A sequence's score is the head applied to the final hidden state of its last real token, the
token transformers picks as the rightmost one that is not `pad_token_id`; here the attention mask says
which tokens are real, so batches are right-padded with `pad_token_id` and both agree.

Legend: B batch, T tokens, H hidden.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from rlhf.schema import ModelConfig
from rlhf.model.hf_io import (
    CONFIG_FILE, from_hf_tensors, hf_config, iter_safetensors, model_config_from_hf, save_pretrained,
)
from rlhf.model.qwen3_moe import Qwen3MoeDecoder

ARCHITECTURE = "Qwen3MoeForSequenceClassification"


class Qwen3MoeRewardModel(Qwen3MoeDecoder):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.score = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Scores [B] (in the parameters' dtype): the score head at each sequence's last real token."""
        B, T = input_ids_BT.shape
        h_BTH = self.hidden_states(input_ids_BT, attention_mask_BT)
        if attention_mask_BT is None:
            last_B = torch.full((B,), T - 1, device=input_ids_BT.device)
        else:
            valid_BT = attention_mask_BT.bool()
            if not valid_BT.any(-1).all():
                raise ValueError("every sequence needs at least one real token (attention_mask 1) to be scored")
            last_B = (torch.arange(T, device=input_ids_BT.device) * valid_BT).argmax(-1)
        return self.score(h_BTH[torch.arange(B, device=h_BTH.device), last_B]).squeeze(-1)


def reward_hf_config(cfg: ModelConfig) -> dict:
    """config.json of a reward model: the decoder's keys, the classifier architecture, one label."""
    return hf_config(cfg) | {
        "architectures": [ARCHITECTURE],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    }


def save_reward_model(
    model: Qwen3MoeRewardModel,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 2 << 30,
) -> Path:
    """Write an HF directory transformers opens as `Qwen3MoeForSequenceClassification`."""
    # The tensors are the decoder's plus `score.weight`, which hf_io's conversion passes through by name;
    # only the config (and the causal LM's generation config) differ from a policy directory.
    out = save_pretrained(model, out_dir, tokenizer_dir, max_shard_bytes)
    (out / CONFIG_FILE).write_text(json.dumps(reward_hf_config(model.config), indent=2) + "\n")
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def load_reward_model(model_dir: str | Path) -> Qwen3MoeRewardModel:
    """Build a reward model from an HF directory; refuses a directory that is not a one-label classifier."""
    d = Path(model_dir)
    if not (d / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{d}: no {CONFIG_FILE}; is this an HF model directory?")
    hf = json.loads((d / CONFIG_FILE).read_text())
    archs = hf.get("architectures") or []
    labels = hf.get("num_labels") or len(hf.get("id2label") or {})
    if ARCHITECTURE not in archs or labels != 1:
        raise ValueError(f"{d}: architectures={archs}, num_labels={labels}; a reward model is a {ARCHITECTURE} "
                         f"with num_labels 1 (write one with rlhf.model.reward_model.save_reward_model)")
    cfg = model_config_from_hf(hf, name=d.name)
    with torch.device("meta"):
        model = Qwen3MoeRewardModel(cfg)
    state = from_hf_tensors(iter_safetensors(d), cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # from_hf_tensors ties an LM head; a reward model has none
    model.load_state_dict(state, strict=True, assign=True)
    return model
