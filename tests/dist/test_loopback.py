"""A local run's groups listen on loopback alone: the trainer's default group (its store and gloo's sockets,
`rlhf.parallel.comm.init_process_group`) and the weight-sync group (`weight_sync.group.transfer_group`), each
rank's listening sockets read from /proc as `ss -ltnp` reads them. torch's own store would listen on every
interface (the second case shows it, so the check can fail)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

from rlhf.parallel.launch import free_port, run_ranks


def listening() -> list[str]:
    """The local addresses of this process's listening TCP sockets."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in mine:  # 0A: LISTEN
                continue
            addr = fields[1].split(":")[0]
            raw = bytes.fromhex(addr)
            if width == 8:
                found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found


def _groups(rank: int, port: int) -> list[str]:
    from weight_sync.group import transfer_group

    group = transfer_group("gloo", "127.0.0.1", port, rank, 2, 30.0)
    try:
        return listening()
    finally:
        group.close()


def _torch_store(rank: int, port: int) -> list[str]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=30))
    try:
        return listening()
    finally:
        del store


def _loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def test_a_local_runs_groups_listen_on_loopback_alone():
    per_rank = run_ranks(_groups, 2, free_port())
    assert all(per_rank), per_rank  # each rank listens (gloo), rank 0 hosts both stores too
    assert len(per_rank[0]) > len(per_rank[1])
    assert all(_loopback(a) for addrs in per_rank for a in addrs), per_rank


def test_torchs_own_store_would_listen_on_every_interface():
    per_rank = run_ranks(_torch_store, 2, free_port())
    assert any(not _loopback(a) for a in per_rank[0]), per_rank  # 0.0.0.0 or ::
