"""A process group's rendezvous store, listening on one address, and gloo's sockets on the same interface.

torch's TCPStore listens on every interface of its machine, without authentication, when it opens its own
socket; here rank 0 opens it, bound to the group's address alone, and hands it to the store
(`master_listen_fd`). A local run's groups use 127.0.0.1 (actors.remote.node_address): nothing of theirs
listens on the machine's network. gloo opens its own listening socket on the interface GLOO_SOCKET_IFNAME
names (else the one its host name resolves to): for a loopback address, `lo` unless the user set another
(docs/security.md). Shared by the trainer's groups (rlhf.parallel.comm) and the weight-sync group
(weight_sync.group).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's store at host:port; rank 0 (`is_master`) hosts it, listening on `host` only."""
    if is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this process's gloo groups listen there too
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=sock.detach())
