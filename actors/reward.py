"""Reward workers: rule verifiers that score decoded responses against reference answers, and a
reward model that scores prompt + response.

Plain classes (Ray actors where the driver spawns them), called the same way:
`score(responses, answers, prompts=None) -> {"scores": [one float per response], "start", "seconds"}`.
`exact_match` is the tiny task's check (the response's leading integer equals the answer); `math_verify`
compares final answers symbolically with Hugging Face's math-verify (LaTeX, fractions, sets, ...), the
verifier DAPO / Open-R1 style math runs use. A response that cannot be parsed scores 0, never an
exception that would stop the run. `RewardModelWorker` (`reward.kind: model`) ignores the answers.
"""

from __future__ import annotations

import time
from typing import Sequence

from rlhf.config.schema import DeviceType, RewardKind


def exact_match(response: str, answer: str) -> float:
    from rlhf.data.arithmetic import is_correct

    return float(is_correct(response, answer))


def math_verify_score(response: str, answer: str) -> float:
    from math_verify import parse, verify

    try:
        gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
        return float(bool(verify(gold, parse(response))))
    except Exception:  # math-verify raises on some malformed LaTeX: an unparseable answer is wrong
        return 0.0


RULES = {RewardKind.exact_match: exact_match, RewardKind.math_verify: math_verify_score}


class RuleRewardWorker:
    def __init__(self, kind: RewardKind):
        if kind not in RULES:
            raise ValueError(f"reward.kind = {kind.value!r} is not a rule verifier; use one of "
                             f"{[k.value for k in RULES]}")
        self.kind, self.rule = kind, RULES[kind]

    def score(self, responses: Sequence[str], answers: Sequence[str], prompts: Sequence[str] | None = None) -> dict:
        """`prompts` is accepted so every reward worker is called alike; rules only read the answers."""
        t0 = time.time()
        scores = [self.rule(r, a) for r, a in zip(responses, answers, strict=True)]
        return {"scores": scores, "start": t0, "seconds": time.time() - t0}


class RewardModelWorker:
    """A reward model (`rlhf.model.reward_model`) with its tokenizer, both from `model_path`.

    The text scored is prompt + response, tokenized as the rollout tokenizes prompts (the tokenizer's
    own special tokens, e.g. a leading <bos>) and cut to the first `max_tokens` tokens (default: the
    model's max_position_embeddings). Sequences are scored in batches of similar length, right-padded.
    """

    def __init__(self, model_path: str, max_tokens: int | None = None, device_type: DeviceType = DeviceType.cpu,
                 batch_size: int = 16):
        import torch

        from rlhf.data.tokenizer import load_tokenizer
        from rlhf.model.reward_model import load_reward_model

        self.device = torch.device("cpu" if device_type is DeviceType.cpu else device_type.value)
        self.model = load_reward_model(model_path).to(self.device).eval()
        self.tok = load_tokenizer(model_path)
        self.max_tokens = max_tokens or self.model.config.max_position_embeddings
        self.batch_size = batch_size

    def score(self, responses: Sequence[str], answers: Sequence[str], prompts: Sequence[str] | None = None) -> dict:
        """One score per response; `answers` is only checked for length (a reward model needs none)."""
        import torch

        t0 = time.time()
        if len(answers) != len(responses) or (prompts is not None and len(prompts) != len(responses)):
            raise ValueError(f"{len(responses)} responses, {len(answers)} answers, "
                             f"{'no' if prompts is None else len(prompts)} prompts: give one of each per response")
        texts = [p + r for p, r in zip(prompts, responses)] if prompts is not None else list(responses)
        # A tokenizer that adds no special token encodes "" to nothing; score such a text as a lone <bos>.
        ids = [e.ids[: self.max_tokens] or [self.model.config.bos_token_id] for e in self.tok.encode_batch(texts)]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths together: little padding
        scores = [0.0] * len(ids)
        pad = self.model.config.pad_token_id
        with torch.no_grad():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                T = max(len(ids[i]) for i in rows)
                input_ids_BT = torch.full((len(rows), T), pad, dtype=torch.long)
                mask_BT = torch.zeros((len(rows), T), dtype=torch.long)
                for b, i in enumerate(rows):
                    input_ids_BT[b, :len(ids[i])] = torch.tensor(ids[i])
                    mask_BT[b, :len(ids[i])] = 1
                scores_B = self.model(input_ids_BT.to(self.device), mask_BT.to(self.device)).float().cpu()
                for i, s in zip(rows, scores_B.tolist()):
                    scores[i] = s
        return {"scores": scores, "start": t0, "seconds": time.time() - t0}
