"""Pipeline stages and the 1F1B schedule, over point-to-point sends between adjacent stages.

Every stage gets the same micro-batches (token ids and masks are small); only hidden states
[B, T, H] travel forward and their gradients backward. Sends are non-blocking (isend, waited at the
end of the schedule) and receives blocking, so the schedule cannot deadlock on a transport whose
sends wait for the receiver. Stage s runs min(pp - s - 1, M) warm-up forwards, then alternates one
forward and one backward, then drains the remaining backwards (PipeDream-flush / Megatron 1F1B):
at most pp - s micro-batches of activations are alive on stage s.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from rlhf.model.layers import autocast_dtype, autocast_off, residual
from rlhf.parallel.comm import LayoutGroups


class PipelineRunner:
    def __init__(self, model, groups: LayoutGroups, stages: Sequence[range], compute: Callable = contextlib.nullcontext):
        """`compute`: a context for each stage's forward (the trainer's autocast)."""
        self.model, self.groups, self.stages, self.compute = model, groups, stages, compute
        layout = groups.layout
        self.stage = layout.coords(groups.rank).pp
        self.first, self.last = self.stage == 0, self.stage == layout.pp - 1
        self.prev = groups.rank - layout.plane
        self.next = groups.rank + layout.plane
        self.hidden = model.config.hidden_size
        self._pending: list = []

    def _stage_forward(self, mb, x_in):
        m = self.model
        with self.compute():
            ctx = m.prepare(mb.input_ids_BT, mb.attention_mask_BT, routing=mb.routing)
            x = residual(m.model.embed_tokens(mb.input_ids_BT)) if self.first else x_in
            for i in self.stages[self.stage]:
                x = m.model.layers[i](x, *ctx)
            return m.model.norm(x) if self.last else x  # the last stage's hidden states: `score` applies the head

    def _recv(self, mb, src: int) -> torch.Tensor:
        B, T = mb.input_ids_BT.shape
        param = next(self.model.parameters())
        with self.compute():  # the residual stream's dtype: the compute dtype under autocast
            dtype = autocast_dtype(param.device.type) or param.dtype
        buf = torch.empty(B, T, self.hidden, dtype=dtype, device=param.device)
        dist.recv(buf, src=src)
        return buf

    def _send(self, t: torch.Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self._pending.append((dist.isend(t, dst=dst), t))

    def _flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def forward_only(self, micro_batches, logprob_fn):
        out = []
        with torch.no_grad():
            for mb in micro_batches:
                x_in = None if self.first else self._recv(mb, self.prev)
                y = self._stage_forward(mb, x_in)
                if self.last:
                    out.append(logprob_fn(y, mb.input_ids_BT))
                else:
                    self._send(y, self.next)
        self._flush()
        return out if self.last else None

    def train(self, micro_batches, loss_fn: Callable, logprob_fn: Callable) -> list[torch.Tensor]:
        M = len(micro_batches)
        warmup = min(self.groups.layout.pp - self.stage - 1, M)
        inputs: list = [None] * M
        outputs: list = [None] * M
        losses: list[torch.Tensor] = []

        def forward_step(i: int) -> None:
            mb = micro_batches[i]
            x_in = None
            if not self.first:
                x_in = self._recv(mb, self.prev).requires_grad_()
            y = self._stage_forward(mb, x_in)
            if self.last:
                logp, ent = logprob_fn(y, mb.input_ids_BT, mb.extras.get("mask"))  # the head on the loss's positions
                y = loss_fn(logp, ent, mb)
                losses.append(y.detach())
            else:
                self._send(y, self.next)
            inputs[i], outputs[i] = x_in, y

        def backward_step(i: int) -> None:
            y = outputs[i]
            if self.last:
                g = None
            else:
                g = torch.empty_like(y)
                dist.recv(g, src=self.next)
            with autocast_off(y.device.type):  # the trainer's step may hold autocast open (`casts_kept`)
                y.backward(g)
            if not self.first:
                self._send(inputs[i].grad, self.prev)
            inputs[i] = outputs[i] = None

        f = b = 0
        for _ in range(warmup):
            forward_step(f)
            f += 1
        for _ in range(M - warmup):
            forward_step(f)
            f += 1
            backward_step(b)
            b += 1
        while b < M:
            backward_step(b)
            b += 1
        self._flush()
        return losses
