"""Expert-parallel token dispatch and combine over the EP group, with inter-node byte accounting.

`FlatDispatcher`: every (token, chosen expert) row goes straight to the EP rank holding the expert
and its output comes straight back (two all-to-alls).
`HierarchicalDispatcher`: a token crosses to each remote node once, then fans out inside the node;
results are bit-identical to flat dispatch, forward and backward.

Both count the bytes of rows that cross a node boundary (`ranks_per_node` of the global rank
numbering), forward and backward, so the hierarchical variant can be compared with the flat one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from rlhf.model.layers import inverse_permutation, permute_rows
from rlhf.parallel.comm import LayoutGroups, all_to_all, exchange_counts

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [R, H], local expert [R]) -> [R, H]


@dataclass
class DispatchStats:
    """Bytes of token rows sent by this rank, and of those the ones crossing a node boundary, for the
    forward pass (dispatch + combine) and the backward pass. Integer metadata is not counted."""

    forward_bytes: int = 0
    forward_inter_node: int = 0
    backward_bytes: int = 0
    backward_inter_node: int = 0

    @property
    def bytes_inter_node(self) -> int:
        return self.forward_inter_node + self.backward_inter_node

    def add(self, nbytes: int, inter: int, backward: bool) -> None:
        if backward:
            self.backward_bytes += nbytes
            self.backward_inter_node += inter
        else:
            self.forward_bytes += nbytes
            self.forward_inter_node += inter


def ranks_per_node(nodes: list[str]) -> int:
    """The ranks per node of a group whose rank r runs on node `nodes[r]`: the dispatchers number nodes in
    equal blocks of consecutive ranks; any other arrangement is refused, naming it."""
    n = len(nodes)
    block = next((i for i in range(1, n) if nodes[i] != nodes[0]), n)
    blocks = [nodes[i:i + block] for i in range(0, n, block)]
    if n % block or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ValueError(f"trainer.hierarchical_ep needs the trainer ranks on their nodes in equal blocks of "
                         f"consecutive ranks; their nodes by rank are {nodes}: place the trainer so (the "
                         f"placement file's devices in node order) or set trainer.hierarchical_ep=false")
    return block


class Dispatcher:
    """Sends each (token, chosen expert) pair to the EP rank holding the expert and returns the
    expert's output for every pair: run(x_SH, shard_Sk, local_Sk, expert_fn) -> y [S * k, H], row
    s * k + j being expert choice j of token s."""

    def __init__(self, groups: LayoutGroups, ranks_per_node: int | None = None):
        self.group = groups.ep
        self.members = groups.ranks["ep"]
        self.rank = groups.rank
        self.me = self.members.index(self.rank)
        self.ranks_per_node = ranks_per_node or groups.layout.world_size
        self.stats = DispatchStats()

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def _account(self, counts: list[int], row_bytes: int, backward: bool = False) -> None:
        inter = sum(c for c, m in zip(counts, self.members) if self.node(m) != self.node(self.rank))
        self.stats.add(sum(counts) * row_bytes, inter * row_bytes, backward)

    def _send_rows(self, rows, send: list[int], recv: list[int]):
        """Differentiable all-to-all of rows; its backward sends `recv` rows back to where they came from."""
        row_bytes = rows.shape[1] * rows.element_size()
        self._account(send, row_bytes)
        if rows.requires_grad:
            self._account(recv, row_bytes, backward=True)
        return all_to_all(rows, send, recv, self.group)

    def _exchange(self, rows, aux, send: list[int]):
        """all-to-all of rows (differentiable) and their integer metadata; returns (rows, aux, recv counts)."""
        recv = exchange_counts(send, self.group, rows.device)
        return self._send_rows(rows, send, recv), all_to_all(aux, send, recv, self.group), recv

    def _return(self, rows, send_back: list[int], recv_back: list[int]):
        return self._send_rows(rows, send_back, recv_back)

    def run(self, x_SH: torch.Tensor, shard_Sk: torch.Tensor, local_Sk: torch.Tensor,
            expert_fn: ExpertFn) -> torch.Tensor:
        raise NotImplementedError


class FlatDispatcher(Dispatcher):
    def run(self, x_SH, shard_Sk, local_Sk, expert_fn):
        S, k = shard_Sk.shape
        rows = x_SH.unsqueeze(1).expand(S, k, x_SH.shape[1]).reshape(S * k, -1)  # backward: sum over k
        if self.group is None:
            return expert_fn(rows, local_Sk.reshape(-1))
        shard_R = shard_Sk.reshape(-1)
        order = torch.argsort(shard_R, stable=True)
        send = torch.bincount(shard_R, minlength=len(self.members)).tolist()
        inverse = inverse_permutation(order)
        x_recv, e_recv, recv = self._exchange(permute_rows(rows, order, inverse), local_Sk.reshape(-1)[order], send)
        y_back = self._return(expert_fn(x_recv, e_recv), recv, send)
        return permute_rows(y_back, inverse, order)


class HierarchicalDispatcher(Dispatcher):
    """Two hops. Hop 1 crosses nodes: a token goes once to each node that holds any of its experts,
    to that node's gateway (the member at this rank's position within its node), with its k slots'
    destinations. Hop 2 stays inside the node: the gateway fans each token out to the members holding
    its experts. Outputs come back per (token, expert) the same way, so the source forms the weighted
    sum exactly as with flat dispatch: same rows, same experts, same result; fewer inter-node bytes on
    the way out whenever tokens pick several experts on one remote node."""

    def __init__(self, groups: LayoutGroups, ranks_per_node: int | None = None):
        super().__init__(groups, ranks_per_node)
        nodes = sorted({self.node(m) for m in self.members})
        self.node_index = {n: i for i, n in enumerate(nodes)}
        self.member_node = torch.tensor([self.node_index[self.node(m)] for m in self.members])
        on_node = [[i for i, m in enumerate(self.members) if self.node_index[self.node(m)] == n]
                   for n in range(len(nodes))]
        pos = on_node[self.node_index[self.node(self.rank)]].index(self.me)
        self.gateway = torch.tensor([members[pos % len(members)] for members in on_node])

    def run(self, x_SH, shard_Sk, local_Sk, expert_fn):
        if self.group is None:
            return FlatDispatcher.run(self, x_SH, shard_Sk, local_Sk, expert_fn)
        S, k = shard_Sk.shape
        n_members, n_nodes = len(self.members), len(self.gateway)
        dev = shard_Sk.device
        node_Sk = self.member_node.to(dev)[shard_Sk]
        # hop 1: one copy per (token, destination node), ordered by gateway then token
        onehot_SN = torch.zeros(S, n_nodes, dtype=torch.bool, device=dev)
        onehot_SN[torch.arange(S, device=dev)[:, None].expand(S, k), node_Sk] = True
        tok_P, node_P = onehot_SN.nonzero(as_tuple=True)
        gw_P = self.gateway.to(dev)[node_P]
        order1 = torch.argsort(gw_P, stable=True)
        tok_P, node_P, gw_P = tok_P[order1], node_P[order1], gw_P[order1]
        on_node_Pk = node_Sk[tok_P] == node_P[:, None]
        dest_Pk = torch.where(on_node_Pk, shard_Sk[tok_P], -1)
        exp_Pk = torch.where(on_node_Pk, local_Sk[tok_P], -1)
        send1 = torch.bincount(gw_P, minlength=n_members).tolist()
        recv1 = exchange_counts(send1, self.group, dev)
        meta_Q = all_to_all(torch.cat([dest_Pk, exp_Pk, tok_P[:, None]], 1), send1, recv1, self.group)
        dest_Qk, exp_Qk, tok_Q = meta_Q[:, :k], meta_Q[:, k:2 * k], meta_Q[:, 2 * k]
        # hop 2 (inside the node): one row per valid slot, to the member holding the expert
        q_V, j_V = (dest_Qk >= 0).nonzero(as_tuple=True)
        src_of_Q = torch.repeat_interleave(torch.arange(n_members, device=dev), torch.tensor(recv1, device=dev))
        back_send = torch.bincount(src_of_Q[q_V], minlength=n_members).tolist()
        back_recv = torch.bincount(gw_P, weights=on_node_Pk.sum(1).double(), minlength=n_members).long().tolist()
        p_R, j_R = on_node_Pk.nonzero(as_tuple=True)
        pos_R = tok_P[p_R] * k + j_R  # where each returning (pair, slot) row belongs
        x_V = _DedupDispatch.apply(x_SH, tok_P, q_V, send1, recv1, back_send, back_recv, pos_R, k, self)
        # hop 2 (inside the node): one row per valid slot, to the member holding the expert
        dest_V = dest_Qk[q_V, j_V]
        order2 = torch.argsort(dest_V, stable=True)
        send2 = torch.bincount(dest_V, minlength=n_members).tolist()
        # Each row's key in flat dispatch's arrival order (source member, then token * k + slot): experts
        # see their rows in exactly flat's order, so weight gradients sum in the same order too.
        key_V = src_of_Q[q_V] * (1 << 40) + tok_Q[q_V] * k + j_V
        aux_V = torch.stack([exp_Qk[q_V, j_V], key_V], 1)[order2]
        x_W, aux_W, recv2 = self._exchange(x_V[order2], aux_V, send2)
        flat_order = torch.argsort(aux_W[:, 1])
        y_W = expert_fn(x_W[flat_order], aux_W[flat_order, 0])[torch.argsort(flat_order)]
        y_V = self._return(y_W, recv2, send2)[torch.argsort(order2)]
        # back across nodes, one row per (token, expert), in (pair, slot) order
        y_rows = self._return(y_V, back_send, back_recv)
        return y_rows[torch.argsort(pos_R)]


class _DedupDispatch(torch.autograd.Function):
    """Hop 1 of hierarchical dispatch: forward sends one copy of a token per destination node and
    the gateway fans it out to its slots; backward returns each slot's gradient to the source and sums
    a token's k slot gradients there, in slot order, exactly as flat dispatch's backward does."""

    @staticmethod
    def forward(ctx, x_SH, tok_P, q_V, send1, recv1, back_send, back_recv, pos_R, k, disp):
        ctx.meta = (back_send, back_recv, pos_R, k, x_SH.shape, disp)
        disp._account(send1, x_SH.shape[1] * x_SH.element_size())
        x_Q = x_SH.new_empty((sum(recv1), x_SH.shape[1]))
        dist.all_to_all_single(x_Q, x_SH[tok_P].contiguous(), recv1, send1, group=disp.group)
        return x_Q[q_V]

    @staticmethod
    def backward(ctx, g_V):
        back_send, back_recv, pos_R, k, shape, disp = ctx.meta
        disp._account(back_send, g_V.shape[1] * g_V.element_size(), backward=True)
        g_rows = g_V.new_empty((sum(back_recv), g_V.shape[1]))
        dist.all_to_all_single(g_rows, g_V.contiguous(), back_recv, back_send, group=disp.group)
        g_SkH = g_rows[torch.argsort(pos_R)].view(shape[0], k, shape[1])
        return (g_SkH.sum(1),) + (None,) * 9
