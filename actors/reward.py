"""Reward workers: rule verifiers that score decoded responses against reference answers, and a
reward model that scores prompt + response.

Plain classes (Ray actors where the driver spawns them), called the same way:
`score(responses, answers, prompts=None) -> ScoreReply` (one score per response).
The rules themselves are pure functions (`rlhf.data.verifiers`). `RewardModelWorker` (`reward.kind: model`)
ignores the answers.
"""

from __future__ import annotations

import time
from typing import Sequence

from actors.replies import ScoreReply
from rlhf.data.verifiers import RULES, score_batch
from rlhf.leftovers import release_programs
from rlhf.schema import DeviceType, RewardKind, SandboxConfig


class RuleRewardWorker:
    """A rule verifier; `sandbox` are the code verifier's limits (`reward.kind: code`)."""

    def __init__(self, kind: RewardKind, sandbox: SandboxConfig = SandboxConfig()):
        if kind not in RULES:
            raise ValueError(f"reward.kind = {kind.value!r} is not a rule verifier; use one of "
                             f"{[k.value for k in RULES]}")
        self.kind, self.sandbox = kind, sandbox
        if kind is RewardKind.code:  # precompiled headers of code workers killed on this machine (100 MB each)
            from rlhf.data.sandbox_box import isolation_problem
            from rlhf.data.sandbox_cpp import remove_dead_dirs

            problem = isolation_problem(sandbox)  # this worker's machine, which may not be the driver's
            if problem:
                raise RuntimeError(problem)
            remove_dead_dirs()

    def score(self, responses: Sequence[str], answers: Sequence[str], prompts: Sequence[str] | None = None) -> ScoreReply:
        """`prompts` is accepted so every reward worker is called alike; rules only read the answers."""
        t0 = time.time()
        if len(answers) != len(responses):
            raise ValueError(f"{len(responses)} responses and {len(answers)} answers: give one answer per response")
        scores, verdicts = score_batch(self.kind, responses, answers, self.sandbox)  # verdicts: kind code
        return ScoreReply(scores, t0, time.time() - t0, dict(verdicts))

    def release(self) -> None:
        """Called before the worker is killed: what its programs ran with let go (`release_programs`)."""
        release_programs()


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

    def release(self) -> None:
        """Called before the worker is killed, as every reward worker is: a reward model holds nothing outside its
        process."""

    def score(self, responses: Sequence[str], answers: Sequence[str], prompts: Sequence[str] | None = None) -> ScoreReply:
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
        return ScoreReply(scores, t0, time.time() - t0)
