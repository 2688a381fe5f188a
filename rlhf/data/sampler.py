"""Prompt sampling for the RL loop, resumable: the cursor (epoch, position) and the shuffle seed are
all it needs, so a checkpoint stores three integers and a resumed run draws exactly the prompts the
uninterrupted run would have drawn."""

from __future__ import annotations

import hashlib
import random
from typing import Sequence, TypeVar

T = TypeVar("T")


class PromptSampler:
    def __init__(self, rows: Sequence[T], per_step: int, seed: int, shuffle: bool = True):
        if not rows:
            raise ValueError("the training prompt set is empty; check data.train_files")
        self.rows, self.per_step, self.seed, self.shuffle = list(rows), per_step, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, count: int | None = None) -> list[T]:
        """The next `count` (default per_step) prompts; a new epoch reshuffles."""
        out = []
        for _ in range(self.per_step if count is None else count):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.rows[self._order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data cursor was drawn with seed {state['seed']}, this run uses "
                             f"seed {self.seed}; resume with seed={state['seed']}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)


def prompt_seed(base: int, prompt: int) -> int:
    """The sampling seed of prompt `prompt` of a call seeded `base`; its k-th sample draws from seed + k
    (vLLM's rule for n > 1). Hashed, not base + prompt: with one seed per call every prompt's k-th sample
    drew the same random numbers, and neighbouring bases (engines, steps, draws) would share streams.
    62 bits, so seed + k stays a valid 64-bit generator seed."""
    digest = hashlib.blake2b(f"{base}:{prompt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2
