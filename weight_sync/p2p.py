"""Run a `Plan` over torch.distributed point-to-point (gloo here; nccl / hccl by the group's backend).

Every rank calls `run_plan` with the same plan and the buffers it holds (source buffers on trainer
ranks, destination buffers on engine ranks, both where roles share a rank). For each (src, dst)
pair both sides derive the same buckets from the plan: transfers in plan order, packed back to back
until `bucket_bytes`. Buckets go in rounds; round r + 1 is posted (packed, isend / irecv) before
round r is copied into the destination buffers, so transport and copy-in overlap and at most two
rounds of buckets are alive. Transfers inside one rank are plain copies.

Checksum: the sender computes, per transfer, `region_checksum` of the region it packed (block sums of
the bytes as int64 words, weighted by odd block numbers); the receiver computes the same over the
region *after* copying it into its destination buffer, and raises naming the tensor and ranks when
they differ. It reads the bytes once more on each side at memory speed, cheap enough for every sync.

Pairs the caller declares to share a device (`same_device`: co-located roles in different processes)
move their buckets through shared memory instead (`weight_sync.shm`: /dev/shm on CPU, IPC handles on
CUDA / NPU), in the same rounds, with the same buckets and the same checksums; only small control
messages go through the group.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Collection, Mapping

import torch
import torch.distributed as dist

from weight_sync.plan import Plan, Transfer


class ChecksumMismatch(RuntimeError):
    """A destination region does not hold what its source sent."""


@dataclass
class SyncStats:
    """What this rank did in one sync."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    bytes_shm: int = 0  # received through shared memory (same-device pairs); not in bytes_received
    bytes_shm_sent: int = 0  # sent through shared memory; not in bytes_sent
    buckets_sent: int = 0
    seconds: float = 0.0
    checked_transfers: int = 0


_BLOCK = 4096  # 8-byte words per checksum block


def region_checksum(t: torch.Tensor) -> int:
    """sum over blocks of (2k + 1) * (sum of the block's 8-byte words), int64 wrapping. Any single flipped
    bit changes it (odd * 2^b is never 0 mod 2^64), and so does data landing in the wrong block. Runs at
    memory speed (native int64 adds), unlike an element-weighted or CRC pass."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    n8 = b.numel() // 8 * 8
    words = b[:n8].view(torch.int64)
    nb = words.numel() // _BLOCK
    total = 0
    if nb:
        sums = words[: nb * _BLOCK].view(nb, _BLOCK).sum(1)
        total = int((sums * torch.arange(1, 2 * nb + 1, 2, dtype=torch.int64, device=sums.device)).sum())
    rest = words[nb * _BLOCK:].sum() * (2 * nb + 1) + (b[n8:].to(torch.int64) * (2 * nb + 3)).sum()
    return (total + int(rest)) & 0xFFFFFFFFFFFFFFFF


def _buckets(transfers: tuple[Transfer, ...], elem_bytes: int, bucket_bytes: int) -> list[list[Transfer]]:
    out: list[list[Transfer]] = [[]]
    size = 0
    for t in transfers:
        n = t.numel * elem_bytes
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out if out[0] else []


def _isend(buf: torch.Tensor, peer: int, group, tag: int = 0):
    return dist.isend(buf, dst=peer, tag=tag) if group is None else group.send([buf], peer, tag)


def _irecv(buf: torch.Tensor, peer: int, group, tag: int = 0):
    return dist.irecv(buf, src=peer, tag=tag) if group is None else group.recv([buf], peer, tag)


def _copy_in(bucket: list[Transfer], flat: torch.Tensor, dst: Mapping[str, torch.Tensor], verify: bool,
             sums: list[tuple[Transfer, int]]) -> None:
    """Copy a bucket's regions from `flat` into the destination buffers; checksum each region after."""
    offset = 0
    for t in bucket:
        region = dst[t.dst_buffer][t.dst_slices()]
        region.copy_(flat[offset:offset + t.numel].view(region.shape))
        offset += t.numel
        if verify:
            sums.append((t, region_checksum(region)))


def _pack_into(bucket: list[Transfer], src: Mapping[str, torch.Tensor], flat: torch.Tensor, verify: bool,
               sums: list[int]) -> None:
    """Copy a bucket's source regions into `flat` back to back; checksum each packed (contiguous) copy, which
    holds the source region's bytes and needs no extra copy to be read."""
    offset = 0
    for t in bucket:
        part = flat[offset:offset + t.numel]
        part.view(t.shape).copy_(src[t.src_buffer][t.src_slices()])
        offset += t.numel
        if verify:
            sums.append(region_checksum(part))


def run_plan(plan: Plan, rank: int, src: Mapping[str, torch.Tensor] | None, dst: Mapping[str, torch.Tensor] | None,
             dtype: torch.dtype, group=None, bucket_bytes: int = 32 << 20, verify: bool = True,
             fault_injector: Callable[[int, torch.Tensor], None] | None = None,
             same_device: Collection[tuple[int, int]] | None = None) -> SyncStats:
    """Move this rank's part of `plan`. `group`: None for the default torch.distributed group (plan
    ranks are global ranks), or a process group whose ranks are the plan's ranks, used through its own
    send / recv (`weight_sync.group.transfer_group`). `same_device`: pairs of plan ranks (either order)
    on one device, whose transfers go through shared memory (`weight_sync.shm`); every rank must pass
    the same pairs. `fault_injector(peer, received_bucket)`, for tests only, may alter a received
    bucket (in shared memory too) before it is copied in (the checksum must then catch it)."""
    t0 = time.perf_counter()
    stats = SyncStats()
    elem = torch.empty((), dtype=dtype).element_size()
    shared = _pair_set(same_device)
    outgoing, incoming, shm_out, shm_in = {}, {}, {}, {}
    for (s, d), transfers in plan.pairs:
        if s == rank and d == rank:
            for t in transfers:
                dst[t.dst_buffer][t.dst_slices()].copy_(src[t.src_buffer][t.src_slices()])
                stats.bytes_local += t.numel * elem
        elif s == rank:
            (shm_out if (s, d) in shared else outgoing)[d] = _buckets(transfers, elem, bucket_bytes)
        elif d == rank:
            (shm_in if (s, d) in shared else incoming)[s] = _buckets(transfers, elem, bucket_bytes)
    rounds = max([len(b) for paths in (outgoing, incoming, shm_out, shm_in) for b in paths.values()], default=0)
    sent_sums: dict[int, list[int]] = {d: [] for d in (*outgoing, *shm_out)}
    pending_sends: list = []
    transport = _shm_transport(rank, group, src, shm_out, shm_in, elem)

    def post(r: int) -> dict[int, tuple]:
        recvs = {}
        for s, buckets in incoming.items():
            if r < len(buckets):
                buf = torch.empty(sum(t.numel for t in buckets[r]), dtype=dtype)
                recvs[s] = (_irecv(buf, s, group), buf, buckets[r])
        for d, buckets in outgoing.items():
            if r < len(buckets):
                parts = [src[t.src_buffer][t.src_slices()].reshape(-1) for t in buckets[r]]
                if verify:
                    sent_sums[d] += [region_checksum(p) for p in parts]
                buf = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                pending_sends.append((_isend(buf, d, group), buf))
                stats.bytes_sent += buf.numel() * elem
                stats.buckets_sent += 1
        for d, buckets in shm_out.items():  # packed straight into the shared slot, once the peer freed it
            if r < len(buckets):
                n = sum(t.numel for t in buckets[r])
                _pack_into(buckets[r], src, transport.slot(d, r, n * elem, dtype), verify, sent_sums[d])
                transport.ready(d, r)
                stats.bytes_shm_sent += n * elem
        return recvs

    received_sums: dict[int, list[tuple[Transfer, int]]] = {s: [] for s in (*incoming, *shm_in)}
    with transport:
        inflight = post(0) if rounds else {}
        for r in range(rounds):
            nxt = post(r + 1) if r + 1 < rounds else {}
            for s, (work, buf, bucket) in inflight.items():
                work.wait()
                if fault_injector is not None:
                    fault_injector(s, buf)
                _copy_in(bucket, buf, dst, verify, received_sums[s])
                stats.bytes_received += buf.numel() * elem
            for s, buckets in shm_in.items():
                if r < len(buckets):
                    n = sum(t.numel for t in buckets[r])
                    flat = transport.wait(s, r, n * elem, dtype)
                    if fault_injector is not None:
                        fault_injector(s, flat)
                    _copy_in(buckets[r], flat, dst, verify, received_sums[s])
                    transport.done(s, r)
                    stats.bytes_shm += n * elem
            inflight = nxt
        transport.finish()
    for work, _ in pending_sends:
        work.wait()
    if verify:
        _compare_checksums(rank, sent_sums, received_sums, group, via_shm=set(shm_in))
        stats.checked_transfers = sum(len(v) for v in received_sums.values())
    stats.seconds = time.perf_counter() - t0
    return stats


def _pair_set(same_device: Collection[tuple[int, int]] | None) -> frozenset[tuple[int, int]]:
    if not same_device:
        return frozenset()
    from weight_sync import shm  # imports this module: loaded only when a caller declares same-device pairs

    return shm.pair_set(same_device)


class _NoTransport:
    """Stands in for `weight_sync.shm.ShmTransport` when this rank has no same-device pair."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def finish(self) -> None:
        pass


def _shm_transport(rank: int, group, src, shm_out: dict, shm_in: dict, elem: int):
    if not shm_out and not shm_in:
        return _NoTransport()
    from weight_sync.shm import ShmTransport

    outgoing = {d: (max(sum(t.numel for t in b) for b in buckets) * elem, src[buckets[0][0].src_buffer].device)
                for d, buckets in shm_out.items()}
    return ShmTransport(rank, group, outgoing, {s: len(buckets) for s, buckets in shm_in.items()})


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _compare_checksums(rank: int, sent: dict[int, list[int]], received: dict[int, list[tuple[Transfer, int]]],
                       group, via_shm: Collection[int] = ()) -> None:
    works = [_isend(torch.tensor([_signed(x) for x in sums], dtype=torch.int64), d, group) for d, sums in sent.items()]
    bad = []
    for s, got in received.items():
        want = torch.empty(len(got), dtype=torch.int64)
        _irecv(want, s, group).wait()
        bad += [(t, s) for (t, value), w in zip(got, want.tolist()) if value != w & 0xFFFFFFFFFFFFFFFF]
    for w in works:
        w.wait()
    if bad:
        t, s = bad[0]
        raise ChecksumMismatch(
            f"weight sync: {t.param} region {t.box} in rank {rank} buffer {t.dst_buffer!r} differs from what rank "
            f"{s} sent{' through shared memory' if s in via_shm else ''} ({len(bad)} region(s) differ); the "
            f"destination does not hold the trainer's weights")
