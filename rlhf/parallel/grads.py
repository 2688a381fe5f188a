"""The trainer's gradients and their memory.

On cpu every trained parameter's gradient is a view of one anonymous mapping (`rlhf.host_memory.AnonymousBuffers`):
- laid out in the optimizer's bucket order, so that each bucket's slice of them is a view, not a copy
  (`rlhf.parallel.optim._flat_view`: 0.28 GB per rank of the small model at every optimizer step);
- handed back to the system between steps (`release`): nothing reads them then, a step starts from zeros, and
  the released pages read as zeros. glibc keeps a freed tensor's pages, so dropping the gradients would not
  give their memory back (0.36 GB per rank of the small model, held through the sync and generation before).
Elsewhere (cuda, npu, mixed dtypes) they are torch's own tensors, dropped between steps.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from rlhf.host_memory import AnonymousBuffers


class Gradients:
    def __init__(self, trained: Mapping[str, torch.nn.Parameter], device: torch.device):
        self.trained, self.device = trained, device
        self.buffers: AnonymousBuffers | None = None
        self.released = False  # the buffers' pages went back: they read as zeros

    def zero(self, buckets: Sequence) -> None:
        """Every trained parameter's gradient zeros, before a step (`buckets`: the optimizer's)."""
        t = self.trained
        if self.buffers is None and self.device.type == "cpu" and len({p.dtype for p in t.values()}) == 1:
            at = {id(p): i for i, p in enumerate(p for b in buckets for p in b.params)}
            order = sorted(t, key=lambda n: at.get(id(t[n]), len(at)))
            self.buffers = AnonymousBuffers({n: tuple(t[n].shape) for n in order}, next(iter(t.values())).dtype,
                                            packed=True, huge_pages=True)
        for n, p in t.items():
            mine = None if self.buffers is None else self.buffers[n]
            if mine is not None and (p.grad is None or p.grad.data_ptr() != mine.data_ptr()):
                p.grad = mine.zero_()  # the first step, or a gradient replaced since (an expert migration)
            elif p.grad is None:
                p.grad = torch.zeros_like(p)
            elif not self.released:
                p.grad.zero_()
        self.released = False

    def release(self) -> None:
        """Give the gradients' memory back until the next step: on cpu the buffers' pages, else the tensors. Once
        per step: the update releases them, and an offload after it finds nothing left to do."""
        if self.released:
            return
        if self.buffers is None:
            for p in self.trained.values():
                p.grad = None
        else:
            self.buffers.release()
            self.released = True
