"""The weight-sync process group: trainer ranks and rollout-engine hosts in one point-to-point group.

The trainer's ranks already belong to their own default torch.distributed group (the training
layout); an engine lives in other processes with its own. So the transfer group is a *stateless*
group: a TCP store on transfer rank 0 and a process group object built over it, used through its own
`send` / `recv` methods (never `torch.distributed.*(group=...)`, which only knows registered groups).
Its ranks are the plan's ranks: trainer rank r is r, engine host k is trainer_world + k.

The backend follows the device: gloo on cpu, nccl on cuda, hccl on npu (torch_npu imported only then).
Every operation carries the group timeout, so a peer that died makes the sync raise, not stall.

On a device backend the group also holds a gloo group over the same store (`control`): the host-memory
messages of co-located pairs (shared-memory handshakes, their checksums) travel there. nccl takes only
device tensors, and refuses two ranks on one GPU, which co-located ranks are.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from weight_sync.store import tcp_store

_PREFIX = "rlhf-weight-sync/"


def transfer_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = 120.0):
    """Join (or, on rank 0, host) the transfer group; every member must call this concurrently."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = tcp_store(host, port, world_size, rank == 0, timeout)  # listening on `host` alone
    prefixed = dist.PrefixStore(_PREFIX, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    elif backend == "hccl":
        import torch_npu  # noqa: F401
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        group = ProcessGroupHCCL(prefixed, rank, world_size, opts)
    else:
        raise ValueError(f"weight-sync backend {backend!r}: use gloo (cpu), nccl (cuda) or hccl (npu)")
    control = None
    if backend != "gloo":
        control = TransferGroup(dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX + "control/", store), rank, world_size,
                                                      timeout), store, rank, world_size)
    return TransferGroup(group, store, rank, world_size, control)


class TransferGroup:
    """A stateless process group and the store it was built on (rank 0's store hosts the server, so
    it lives as long as the group). `send` / `recv` take the group's own ranks. `control`: the gloo group
    for host-memory messages (itself when the group is gloo)."""

    def __init__(self, group, store, rank: int, world_size: int, control: "TransferGroup | None" = None):
        self.group, self.store, self.rank, self.world_size = group, store, rank, world_size
        self.control = self if control is None else control

    def send(self, tensors, peer: int, tag: int = 0):
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors, peer: int, tag: int = 0):
        return self.group.recv(tensors, peer, tag)

    def close(self) -> None:
        """Shut the group down and drop the store: its threads and connections must not outlive the
        member (a vLLM worker that still holds them does not exit when its engine shuts down)."""
        group, self.group, self.store = self.group, None, None
        if self.control is not self:
            self.control.close()
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # already broken (a peer died): nothing left to wind down
                pass


def control_of(group):
    """Where host-memory control messages go: the group's gloo side (None: the default group)."""
    return None if group is None else group.control


def isend(buf: torch.Tensor, peer: int, group=None, tag: int = 0):
    """Post a send to `peer` on `group` (a `TransferGroup`), or on the default group when None."""
    return dist.isend(buf, dst=peer, tag=tag) if group is None else group.send([buf], peer, tag)


def irecv(buf: torch.Tensor, peer: int, group=None, tag: int = 0):
    """Post a receive from `peer` on `group` (a `TransferGroup`), or on the default group when None."""
    return dist.irecv(buf, src=peer, tag=tag) if group is None else group.recv([buf], peer, tag)
