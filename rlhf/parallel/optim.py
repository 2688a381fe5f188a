"""AdamW with its state sharded over the ranks that hold identical copies of a parameter (ZeRO-1).

After gradient sync, every rank of a parameter's reduction group (DP ranks; the whole stage for the
router and q/k norms; expert replicas for experts) holds the same parameter and the same gradient.
So each of the R ranks keeps AdamW state (exp_avg, exp_avg_sq) and the parameter values for one 1/R
slice of the group's flattened parameters, steps only that slice with torch's own AdamW, and one
all-gather per group rebuilds the full parameters. Optimizer-state memory drops by R; the update is
elementwise, so the result equals an unsharded AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rlhf.host_memory import AnonymousBuffers
from rlhf.parallel.comm import all_gather_single, flat_view

GATHER_BYTES = 32 << 20  # a ZeRO-1 bucket's stepped slices are gathered back this much of each at a time


@dataclass
class _Bucket:
    kind: str
    group: object  # process group, or None for a single rank
    size: int  # ranks sharing the state
    index: int  # this rank's slice
    params: list[nn.Parameter]
    numel: int
    chunk: int  # slice length (the last slice is padded)
    lo: int
    hi: int
    master: torch.Tensor  # this rank's slice of the flattened parameters (the optimizer's parameter)


class ShardedAdamW:
    def __init__(self, buckets: dict[str, tuple[object, int, int, list[nn.Parameter]]], lr: float,
                 betas: tuple[float, float], eps: float, weight_decay: float):
        """`buckets`: kind -> (group, group size, this rank's index in it, parameters)."""
        self.buckets: list[_Bucket] = []
        for kind, (group, size, index, params) in buckets.items():
            numel = sum(p.numel() for p in params)
            chunk = -(-numel // size)
            lo, hi = min(index * chunk, numel), min((index + 1) * chunk, numel)
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            master = flat[lo:hi].clone() if size > 1 else flat
            if size == 1:  # this rank steps the whole bucket: its parameters become views of the master, one copy
                for p, _, to, n in _segments(params, 0, numel):  # fewer (0.2 GB per rank of the small model)
                    p.data = master[to:to + n].view_as(p)
            self.buckets.append(_Bucket(kind, group, size, index, params, numel, chunk, lo, hi, master))
        # fused: one pass over each master slice (torch's CPU and CUDA kernels; 6x the multi-tensor path on one
        # CPU thread, equal to it within float rounding); other devices keep torch's default
        fused = bool(self.buckets) and all(b.master.device.type in ("cpu", "cuda") for b in self.buckets)
        self.opt = torch.optim.AdamW([b.master for b in self.buckets], lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, fused=fused or None)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps so far (torch's AdamW step count, which checkpoints carry)."""
        state = self.opt.state.get(self.buckets[0].master, {}) if self.buckets else {}
        return int(state["step"]) if "step" in state else 0

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        """This rank's slice of every bucket steps; one all-gather per bucket puts the slices back into every
        replica's parameters. Gradients and parameters are read and written slice by slice: no flat copy of a
        whole bucket (about 1 GB per rank of the small model when it was cat + clone + cat each step), and where
        a bucket's gradients lie back to back in memory (the trainer's gradient buffer on cpu) the slice is a view
        of them, no copy at all (0.28 GB per rank of the small model)."""
        for b in self.buckets:
            g = flat_view([p.grad for p in b.params], b.lo, b.hi)
            if g is None or g.dtype != b.master.dtype:
                g = torch.empty_like(b.master)
                for p, at, to, n in _segments(b.params, b.lo, b.hi):
                    g[to:to + n] = p.grad.reshape(-1)[at:at + n]
            b.master.grad = g
        self.opt.step()
        with torch.no_grad():
            for b in self.buckets:
                mine = b.master.detach()
                if b.size == 1:
                    if not _views_of(b.params, mine):  # no longer (an offload to another device copied them)
                        _write(b.params, 0, mine)
                else:  # in pieces of GATHER_BYTES a slice: the gathered copy of a whole bucket peaked the step
                    every = max(1, min(b.chunk, GATHER_BYTES // mine.element_size()))
                    # one flat buffer for every piece: a list of parts made gloo copy each piece in and out again.
                    # On cpu an anonymous mapping of small pages: first touched each step, malloc's block of it would
                    # come in huge pages (`huge_page_env`), whose first fault costs 6x more here (80 ms a 32 MB piece)
                    held = AnonymousBuffers({"g": (b.size * every,)}, mine.dtype) if mine.device.type == "cpu" \
                        else {"g": mine.new_empty(b.size * every)}
                    gathered = held["g"]
                    for s in range(0, b.chunk, every):
                        e = min(b.chunk, s + every)
                        piece = mine[s:e]
                        if piece.numel() < e - s:  # the last slice is padded (or empty) to the common length
                            piece = torch.cat([piece, piece.new_zeros(e - s - piece.numel())])
                        parts = gathered[:b.size * (e - s)].view(b.size, e - s)
                        all_gather_single(parts.view(-1), piece, group=b.group)
                        for i, part in enumerate(parts):
                            at = i * b.chunk + s
                            _write(b.params, at, part[:max(0, min(e - s, b.numel - at))])
                b.master.grad = None

    # --- expert migration ---
    def full_moments(self, wanted: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Each parameter's whole AdamW moments (exp_avg, exp_avg_sq), shaped like it, for every bucket holding
        a parameter whose id() is in `wanted`: one all-gather per such bucket over its ranks (every rank of
        the bucket's group must call this for the same buckets). The views are writable: change them, then
        `keep_moments` puts this rank's slices back. Before the first step the moments are zeros."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for b in self.buckets:
            if not any(id(p) in wanted for p in b.params):
                continue
            state = self.opt.state.get(b.master) or {}
            full = []
            for key in ("exp_avg", "exp_avg_sq"):
                mine = b.master.new_zeros(b.chunk)
                if key in state:
                    mine[: b.hi - b.lo] = state[key]
                if b.size == 1:
                    flat = mine
                else:
                    parts = [torch.empty_like(mine) for _ in range(b.size)]
                    dist.all_gather(parts, mine, group=b.group)
                    flat = torch.cat(parts)
                full.append(flat[: b.numel])
            offset = 0
            for p in b.params:
                n = p.numel()
                out[id(p)] = tuple(f[offset:offset + n].view_as(p) for f in full)
                offset += n
        return out

    def keep_moments(self, full: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After `full_moments` and a change of the parameters and of those moments (experts moved between
        ranks): this rank's slice of each bucket's moments, and its master slice from the parameters."""
        for b in self.buckets:
            if not any(id(p) in full for p in b.params):
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in b.params])
            with torch.no_grad():
                b.master.copy_(flat[b.lo:b.hi])
            state = self.opt.state.get(b.master)
            if not state:  # no step taken yet: the moments are zeros and stay implicit
                continue
            for i, key in enumerate(("exp_avg", "exp_avg_sq")):
                moments = torch.cat([full[id(p)][i].reshape(-1) for p in b.params])
                state[key].copy_(moments[b.lo:b.hi])

    # --- checkpoints ---
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer state as `<bucket kind>/<master|exp_avg|exp_avg_sq|step>`. Before the
        first step torch's AdamW holds no state; it then starts from zero moments and step 0, which is
        what is returned, so a state taken at any time loads the same way."""
        out: dict[str, torch.Tensor] = {}
        for b in self.buckets:
            state = self.opt.state.get(b.master) or {}
            # a master the parameters are views of: a copy (a safetensors file refuses two names for one memory)
            out[f"{b.kind}/master"] = b.master.clone() if _views_of(b.params, b.master) else b.master
            out[f"{b.kind}/exp_avg"] = state.get("exp_avg", torch.zeros_like(b.master))
            out[f"{b.kind}/exp_avg_sq"] = state.get("exp_avg_sq", torch.zeros_like(b.master))
            out[f"{b.kind}/step"] = state.get("step", torch.tensor(0.0))
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `state_tensors` returned, bit-exactly (keys and shapes checked by the caller)."""
        for b in self.buckets:
            with torch.no_grad():
                b.master.copy_(tensors[f"{b.kind}/master"])
            self.opt.state[b.master] = {
                "step": self._step_tensor(tensors[f"{b.kind}/step"], b.master),
                "exp_avg": tensors[f"{b.kind}/exp_avg"].detach().to(b.master.device, copy=True),
                "exp_avg_sq": tensors[f"{b.kind}/exp_avg_sq"].detach().to(b.master.device, copy=True),
            }

    def _step_tensor(self, step: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The step count where torch's AdamW keeps it: on the host, except for the fused and capturable
        kernels, which read it on the parameter's device as float32 (a host step loaded from a checkpoint
        stops the fused CUDA kernel: "state_steps is on cpu")."""
        group = self.opt.param_groups[0]
        if group.get("fused") or group.get("capturable"):
            return step.detach().to(master.device, torch.float32, copy=True)
        return step.detach().clone()

    def owned_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer owns (parameter slices, moments), for offload/onload."""
        out = []
        for b in self.buckets:
            out.append(b.master)
            state = self.opt.state.get(b.master, {})
            out += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
        return out

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.owned_tensors())


def _segments(params, lo: int, hi: int):
    """(param, offset in it, offset in [lo, hi), length) for each parameter overlapping the flat range [lo, hi)
    of the parameters laid end to end."""
    offset = 0
    for p in params:
        n = p.numel()
        a, z = max(lo, offset), min(hi, offset + n)
        if a < z:
            yield p, a - offset, a - lo, z - a
        offset += n


def _views_of(params, flat: torch.Tensor) -> bool:
    """Whether the parameters laid end to end are `flat` itself (the same memory)."""
    view = flat_view([p.detach() for p in params], 0, flat.numel())
    return view is not None and view.data_ptr() == flat.data_ptr() and view.numel() == flat.numel()


def _write(params, lo: int, values: torch.Tensor) -> None:
    """The flat range [lo, lo + len(values)) of the parameters laid end to end := values."""
    for p, at, frm, n in _segments(params, lo, lo + values.numel()):
        if p.is_contiguous():
            p.view(-1)[at:at + n].copy_(values[frm:frm + n])
        else:  # no flat view of it: through a flat copy
            flat = p.reshape(-1).clone()
            flat[at:at + n] = values[frm:frm + n]
            p.copy_(flat.view_as(p))
