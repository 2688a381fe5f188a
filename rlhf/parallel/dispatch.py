"""Expert-parallel token dispatch and combine over the EP group, with inter-node byte accounting.

`FlatDispatcher`: every (token, chosen expert) row goes straight to the EP rank holding the expert
and its output comes straight back (two all-to-alls).

Both count the bytes of rows that cross a node boundary (`ranks_per_node` of the global rank
numbering), forward and backward, so the hierarchical variant can be compared with the flat one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from rlhf.parallel.comm import LayoutGroups, all_to_all, exchange_counts

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [R, H], local expert [R]) -> [R, H]


@dataclass
class DispatchStats:
    rows_sent: int = 0
    bytes_sent: int = 0
    bytes_inter_node: int = 0  # of bytes_sent, those whose destination is on another node

    def add(self, rows: int, nbytes: int, inter: int) -> None:
        self.rows_sent += rows
        self.bytes_sent += nbytes
        self.bytes_inter_node += inter


class Dispatcher:
    def __init__(self, groups: LayoutGroups, ranks_per_node: int | None = None):
        self.group = groups.ep
        self.members = groups.ranks["ep"]
        self.rank = groups.rank
        self.ranks_per_node = ranks_per_node or groups.layout.world_size
        self.stats = DispatchStats()

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _account(self, counts: list[int], row_bytes: int) -> None:
        inter = sum(c for c, m in zip(counts, self.members) if self.node(m) != self.node(self.rank))
        self.stats.add(sum(counts), sum(counts) * row_bytes, inter * row_bytes)

    def run(self, rows_RH: torch.Tensor, shard_R: torch.Tensor, local_expert_R: torch.Tensor,
            expert_fn: ExpertFn) -> torch.Tensor:
        raise NotImplementedError


class FlatDispatcher(Dispatcher):
    def run(self, rows_RH, shard_R, local_expert_R, expert_fn):
        if self.group is None:
            return expert_fn(rows_RH, local_expert_R)
        n = len(self.members)
        order = torch.argsort(shard_R, stable=True)
        send = torch.bincount(shard_R, minlength=n).tolist()
        recv = exchange_counts(send, self.group)
        row_bytes = rows_RH.shape[1] * rows_RH.element_size()
        self._account(send, row_bytes)
        x_recv = all_to_all(rows_RH[order], send, recv, self.group)
        e_recv = all_to_all(local_expert_R[order], send, recv, self.group)
        y_recv = expert_fn(x_recv, e_recv)
        self._account(recv, row_bytes)  # the combine sends back what we received
        y_back = all_to_all(y_recv, recv, send, self.group)
        return y_back[torch.argsort(order)]
