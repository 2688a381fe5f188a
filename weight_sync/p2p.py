"""Run a `Plan` over torch.distributed point-to-point (gloo here; nccl / hccl by the group's backend).

Every rank calls `run_plan` with the same plan and the buffers it holds (source buffers on trainer
ranks, destination buffers on engine ranks, both where roles share a rank). For each (src, dst)
pair both sides derive the same buckets from the plan: transfers in plan order, packed back to back
until `bucket_bytes`. Buckets go in rounds; round r + 1 is posted (packed, isend / irecv) before
round r is copied into the destination buffers, so transport and copy-in overlap and at most two
rounds of buckets are alive. A transfer of 256 KiB or more (`alone_bytes`) is a bucket of its own, sent
from its source region and received into its destination region in place where each is contiguous.
Transfers inside one rank are plain copies.

Checksum: the sender computes `bucket_checksum` of every bucket as it leaves (one int64 sum per 4 KiB
block of its bytes), the receiver the same of the bucket as it arrived, before copying it in; each
sender sends its sums to its receivers (8 bytes per 4 KiB), which compare and raise naming the tensors
of the first differing block and both ranks. Sums that travel in host memory (every pair on cpu, and
shared-memory pairs on devices) leave as soon as the last bucket to that receiver is packed, on a tag
of their own, into a receive posted at the start: a receiver compares once its own data is in, without
waiting for its senders' other peers; on a device backend the others go in one batch at the end. One
vectorized pass over each bucket on each side (about 16 GB/s on one core here, out of cache), whatever
the number of transfers in it.

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

from weight_sync.group import control_of, irecv, isend
from weight_sync.plan import Plan, Transfer
from weight_sync.shm import ShmTransport, pair_set


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
    bytes_in_place: int = 0  # of bytes_received, received straight into the destination buffer (no copy-in)
    buckets_sent: int = 0
    seconds: float = 0.0
    checked_transfers: int = 0
    nonfinite: str | None = None  # with `check_finite`: a parameter whose received region holds NaN or inf


_BLOCK_BYTES = 4096  # checksum block
TAG_SUMS = 3  # block sums sent as soon as a peer's last bucket is packed (shared memory's control messages use 1, 2)
TAG_GO = 4  # a sender's announcement that it starts (`announce`: for a receive posted before the sender's update ended)


def bucket_checksum(flat: torch.Tensor) -> torch.Tensor:
    """Block sums of a packed bucket (contiguous): the int64 (wrapping) sum of each full 4 KiB block of
    its bytes read as 8-byte words, then, when the size is not a multiple of 4 KiB, of the remaining
    words and of the remaining bytes. Any single flipped bit changes its block's sum (+-2^b is never
    0 mod 2^64), and comparing block by block locates the damage to 4 KiB. One pass at memory speed, on
    the bucket's device."""
    nbytes = flat.numel() * flat.element_size()
    if nbytes % _BLOCK_BYTES == 0 and flat.data_ptr() % 8 == 0:  # the common case, in one reduction
        return flat.view(-1).view(torch.int64).view(-1, _BLOCK_BYTES // 8).sum(1)
    b = flat.reshape(-1).view(torch.uint8)
    if b.data_ptr() % 8:  # a view into a larger buffer (a single-region bucket sent in place)
        b = b.clone()
    full, n8 = nbytes // _BLOCK_BYTES * _BLOCK_BYTES, nbytes // 8 * 8
    blocks = b[:full].view(torch.int64).view(-1, _BLOCK_BYTES // 8).sum(1)
    if full == nbytes:  # the same entries as the aligned case, whatever the alignment
        return blocks
    return torch.cat([blocks, b[full:n8].view(torch.int64).sum().view(1), b[n8:].to(torch.int64).sum().view(1)])


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in `t`. Its sum is finite exactly when every element is, unless finite elements overflow
    the sum (then the elementwise check decides): a NaN or an inf element makes any IEEE sum NaN or inf. One
    reduction instead of an elementwise pass into a bool tensor and a second reduction."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _n_sums(nbytes: int) -> int:
    """How many entries `bucket_checksum` gives for a bucket of `nbytes`."""
    return nbytes // _BLOCK_BYTES + (2 if nbytes % _BLOCK_BYTES else 0)


def _block_bytes(i: int, nbytes: int) -> tuple[int, int]:
    """Byte range of a bucket that entry `i` of its `bucket_checksum` covers."""
    nb, n8 = nbytes // _BLOCK_BYTES, nbytes // 8 * 8
    if i < nb:
        return i * _BLOCK_BYTES, (i + 1) * _BLOCK_BYTES
    return (nb * _BLOCK_BYTES, n8) if i == nb else (n8, nbytes)


def _buckets(transfers: tuple[Transfer, ...], elem_bytes: int, bucket_bytes: int,
             alone_bytes: float = float("inf")) -> list[list[Transfer]]:
    """Transfers in plan order packed back to back up to `bucket_bytes`; one of `alone_bytes` or more is a
    bucket of its own (moved in place where its regions are contiguous)."""
    out: list[list[Transfer]] = []
    size = bucket_bytes  # no open bucket
    for t in transfers:
        n = t.numel * elem_bytes
        if n >= alone_bytes:
            out.append([t])
            size = bucket_bytes
            continue
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


class _Batch:
    """A round of sends and receives on the group. Backends that run point-to-point operations as device
    kernels (nccl, hccl: `supports_coalescing`) get them as one group launch (ncclGroupStart / End),
    without which two ranks sending to each other can deadlock; gloo runs each one as it is issued.
    `active`: whether the round posts anything (an empty group launch is not opened). Run on CUDA (nccl)."""

    def __init__(self, group, device: torch.device, active: bool = True):
        backend = getattr(group, "group", None)  # a TransferGroup's c10d backend (not a ProcessGroup: no device)
        on = active and backend is not None and device.type != "cpu" and backend.supports_coalescing
        self.backend, self.device, self.work = backend if on else None, device, None

    def __enter__(self):
        if self.backend is not None:
            self.backend._start_coalescing()
        return self

    def __exit__(self, *exc):
        if self.backend is not None:
            self.work = self.backend._end_coalescing()

    def track(self, work):
        """What to wait on: the operation's own work, or the group launch's."""
        return work if self.backend is None else self

    def wait(self):
        self.work.wait()


class _DstRegions:
    """This rank's destination regions, bucket by bucket, as views into its destination buffers: built on first
    use, reused while `run_plan` gets the same plan object and the same buffer tensors (an engine worker's
    staging buffers, sync after sync). Index arithmetic and view creation per transfer were most of a small
    model's copy-in time (~100 transfers per sync on the tiny model). One per process: it keeps that plan and
    those buffers alive until a call with others replaces it (`forget_regions` drops it)."""

    last: "_DstRegions | None" = None

    def __init__(self, plan: Plan, rank: int, dst: Mapping[str, torch.Tensor], buckets: tuple):
        self.plan, self.rank, self.tensors, self.buckets = plan, rank, tuple(dst.items()), buckets
        self.views: dict[tuple, tuple[list[torch.Tensor], list[int]]] = {}

    @classmethod
    def of(cls, plan: Plan, rank: int, dst: Mapping[str, torch.Tensor], buckets: tuple) -> "_DstRegions":
        """`buckets`: what else decides the buckets (sizes, the travelling dtype, the shared-memory pairs)."""
        c = cls.last
        if (c is None or c.plan is not plan or c.rank != rank or c.buckets != buckets or len(c.tensors) != len(dst)
                or any(dst.get(n) is not t for n, t in c.tensors)):
            c = cls.last = cls(plan, rank, dst, buckets)
        return c

    def copy_in(self, key: tuple, bucket: list[Transfer], flat: torch.Tensor) -> None:
        """Copy a bucket's regions from `flat` into the destination buffers (`key`: the bucket's peer, path and
        round, which with the plan determine the bucket)."""
        views = self.views.get(key)
        if views is None:
            dst = dict(self.tensors)
            views = self.views[key] = ([dst[t.dst_buffer][t.dst_slices()] for t in bucket], [t.numel for t in bucket])
        for region, part in zip(views[0], flat.split(views[1])):
            region.copy_(part.view(region.shape))


def forget_regions() -> None:
    """Drop the kept destination views (and with them the plan and buffers they hold)."""
    _DstRegions.last = None


def _in_place(bucket: list[Transfer], dst: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """The destination region of a one-transfer bucket as a flat view, when it is contiguous and of the
    dtype that travels (otherwise the bucket is received apart and cast as it is copied in)."""
    if len(bucket) != 1:
        return None
    region = dst[bucket[0].dst_buffer][bucket[0].dst_slices()]
    return region.view(-1) if region.is_contiguous() and region.dtype == dtype else None


def _pack_into(bucket: list[Transfer], src: Mapping[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a bucket's source regions into `flat` back to back."""
    offset = 0
    for t in bucket:
        flat[offset:offset + t.numel].view(t.shape).copy_(src[t.src_buffer][t.src_slices()])
        offset += t.numel


def run_plan(plan: Plan, rank: int, src: Mapping[str, torch.Tensor] | None, dst: Mapping[str, torch.Tensor] | None,
             dtype: torch.dtype, group=None, bucket_bytes: int = 32 << 20, verify: bool = True,
             fault_injector: Callable[[int, torch.Tensor], None] | None = None,
             same_device: Collection[tuple[int, int]] | None = None, alone_bytes: int = 256 << 10,
             check_finite: bool = False) -> SyncStats:
    """Move this rank's part of `plan`. `dtype` is what travels: sources of another dtype are cast as
    they are packed (an fp32 master copy sent to bf16 engines), destinations as they are copied in.
    `group`: None for the default torch.distributed group (plan ranks are global ranks), or a process
    group whose ranks are the plan's ranks, used through its own send / recv
    (`weight_sync.group.transfer_group`). `same_device`: pairs of plan ranks (either order)
    on one device, whose transfers go through shared memory (`weight_sync.shm`); every rank must pass
    the same pairs. A transfer of `alone_bytes` or more travels as a message of its own, sent straight
    from its source region and received straight into its destination region where those are
    contiguous (no packing, no copy-in). `fault_injector(peer, received_bucket)`, for tests only, may
    alter a received bucket (in shared memory too; the destination region itself for a transfer
    received in place) before it is copied in (the checksum must then catch it). `check_finite`: each
    received bucket of a floating dtype (bytes of a quantized sync are checked by their receiver as tensors) is also
    checked for NaN / inf in one reduction; the first offender's parameter is
    reported in `SyncStats.nonfinite` once the exchange has completed (no rank leaves it half-way)."""
    t0 = time.perf_counter()
    stats = SyncStats()
    elem = torch.empty((), dtype=dtype).element_size()
    shared = pair_set(same_device)
    outgoing, incoming, shm_out, shm_in = {}, {}, {}, {}
    for (s, d), transfers in plan.pairs:
        if s == rank and d == rank:
            for t in transfers:
                dst[t.dst_buffer][t.dst_slices()].copy_(src[t.src_buffer][t.src_slices()])
                stats.bytes_local += t.numel * elem
        elif s == rank:
            if (s, d) in shared:
                shm_out[d] = _buckets(transfers, elem, bucket_bytes)
            else:
                outgoing[d] = _buckets(transfers, elem, bucket_bytes, alone_bytes)
        elif d == rank:
            if (s, d) in shared:
                shm_in[s] = _buckets(transfers, elem, bucket_bytes)
            else:
                incoming[s] = _buckets(transfers, elem, bucket_bytes, alone_bytes)
    rounds = max([len(b) for paths in (outgoing, incoming, shm_out, shm_in) for b in paths.values()], default=0)
    sent_sums: dict[int, list[torch.Tensor]] = {d: [] for d in (*outgoing, *shm_out)}
    pending_sends: list = []
    transport = _shm_transport(rank, group, src, shm_out, shm_in, elem)
    device = next(iter((dst or src or {}).values()), torch.empty(0)).device  # of the data this rank moves
    # Peers whose block sums travel in host memory (shared-memory pairs; every peer on cpu) get them as soon as
    # the last bucket to them is packed, not after this rank's whole exchange: a receiver compares once its own
    # data is in. On a device backend the others' sums go in one batch at the end (`_compare_checksums`).
    early = set(shm_in) | set(shm_out) | (set(incoming) | set(outgoing) if device.type == "cpu" else set())
    early_sends: list = []
    early_recvs = {s: _post_sums(buckets, s, elem, group) for s, buckets in (*incoming.items(), *shm_in.items())
                   if verify and s in early}

    def post(r: int) -> dict[int, tuple]:
        recvs = {}
        active = any(r < len(b) for b in (*incoming.values(), *outgoing.values()))
        with _Batch(group, device, active) as batch:
            for s, buckets in incoming.items():
                if r < len(buckets):
                    buf = _in_place(buckets[r], dst, dtype)
                    in_place = buf is not None
                    if not in_place:
                        buf = torch.empty(sum(t.numel for t in buckets[r]), dtype=dtype,
                                          device=dst[buckets[r][0].dst_buffer].device)
                    recvs[s] = (batch.track(irecv(buf, s, group)), buf, buckets[r], in_place)
            for d, buckets in outgoing.items():
                if r < len(buckets):
                    parts = [src[t.src_buffer][t.src_slices()].reshape(-1).to(dtype) for t in buckets[r]]
                    buf = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
                    pending_sends.append((batch.track(isend(buf, d, group)), buf))
                    if verify:  # read while it travels
                        sent_sums[d].append(bucket_checksum(buf))
                    stats.bytes_sent += buf.numel() * elem
                    stats.buckets_sent += 1
        for d, buckets in shm_out.items():  # packed straight into the shared slot, once the peer freed it
            if r < len(buckets):
                n = sum(t.numel for t in buckets[r])
                slot = transport.slot(d, r, n * elem, dtype)
                _pack_into(buckets[r], src, slot)
                if verify:
                    sent_sums[d].append(bucket_checksum(slot))
                transport.ready(d, r)
                stats.bytes_shm_sent += n * elem
        for d, buckets in (*outgoing.items(), *shm_out.items()):
            if verify and d in early and r == len(buckets) - 1:
                sums = torch.cat(sent_sums[d]).cpu()
                early_sends.append((isend(sums, d, control_of(group), TAG_SUMS), sums))
        return recvs

    received_sums: dict[int, list[tuple[list[Transfer], torch.Tensor]]] = {s: [] for s in (*incoming, *shm_in)}

    def arrived(s: int, bucket: list[Transfer], flat: torch.Tensor) -> None:
        """What every received bucket goes through, from the group or shared memory, before it is copied in."""
        if fault_injector is not None:
            fault_injector(s, flat)
        if verify:
            received_sums[s].append((bucket, bucket_checksum(flat)))
        if check_finite and flat.is_floating_point() and stats.nonfinite is None and not all_finite(flat):
            stats.nonfinite = _nonfinite_param(bucket, flat)
    regions = (_DstRegions.of(plan, rank, dst, (bucket_bytes, alone_bytes, dtype, shared))
               if dst is not None and (incoming or shm_in) else None)
    with transport:
        inflight = post(0) if rounds else {}
        for r in range(rounds):
            nxt = post(r + 1) if r + 1 < rounds else {}
            for s, (work, buf, bucket, in_place) in inflight.items():
                work.wait()
                arrived(s, bucket, buf)
                if in_place:
                    stats.bytes_in_place += buf.numel() * elem
                else:
                    regions.copy_in((s, "net", r), bucket, buf)
                stats.bytes_received += buf.numel() * elem
            for s, buckets in shm_in.items():
                if r < len(buckets):
                    n = sum(t.numel for t in buckets[r])
                    flat = transport.wait(s, r, n * elem, dtype)
                    arrived(s, buckets[r], flat)
                    regions.copy_in((s, "shm", r), buckets[r], flat)
                    transport.done(s, r)
                    stats.bytes_shm += n * elem
            inflight = nxt
        transport.finish()
    for work, _ in pending_sends + early_sends:
        work.wait()
    if verify:
        _compare_checksums(rank, {d: v for d, v in sent_sums.items() if d not in early}, received_sums, elem, group,
                           via_shm={*shm_in, *shm_out}, early=early_recvs)
        stats.checked_transfers = sum(len(b) for v in received_sums.values() for b, _ in v)
    stats.seconds = time.perf_counter() - t0
    return stats


def _nonfinite_param(bucket: list[Transfer], flat: torch.Tensor) -> str:
    """The parameter of the first transfer in a bucket whose elements are not all finite."""
    offset = 0
    for t in bucket:
        if not all_finite(flat.reshape(-1)[offset:offset + t.numel]):
            return t.param
        offset += t.numel
    return bucket[0].param


def announce(plan: Plan, rank: int, group=None, starts: bool = True) -> list:
    """Tell every rank this one sends to in `plan` that its part starts now, for receivers that posted
    their receive before this rank had anything to send (`await_senders`); one int64 each, in host memory.
    `starts=False`: that it sends nothing (its update failed), so that they stop waiting at once. Returns the
    sends' works (done once the receivers took them)."""
    one = torch.tensor([rank if starts else -1], dtype=torch.int64)
    return [isend(one, d, control_of(group), TAG_GO) for (s, d), _ in plan.pairs if s == rank and d != rank]


def await_senders(plan: Plan, rank: int, group=None, timeout_s: float = 3600.0) -> float:
    """Wait, at most `timeout_s` in all, for the announcement of every rank that sends to this one in `plan`
    (a receive posted while its senders still update: the group's own timeout would be the update's limit).
    A sender that died closes its connection, which ends the wait at once with an error. Returns the time
    (time.time) the last announcement came: where this rank's part of the sync really starts."""
    import datetime

    deadline = time.monotonic() + timeout_s
    posted = [(s, torch.empty(1, dtype=torch.int64)) for (s, d), _ in plan.pairs if d == rank and s != rank]
    works = [(s, irecv(buf, s, control_of(group), TAG_GO)) for s, buf in posted]
    for (s, work), (_, buf) in zip(works, posted):
        left = max(deadline - time.monotonic(), 0.001)
        try:
            work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as e:
            raise RuntimeError(f"weight sync: rank {rank} waited {timeout_s:.0f} s for rank {s} to start sending: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        if int(buf[0]) < 0:  # said at once, without waiting for the other senders
            raise RuntimeError(f"weight sync: rank {s} sends nothing (its update did not finish); rank {rank} keeps "
                               f"the weights it has")
    return time.time()


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
    outgoing = {d: (max(sum(t.numel for t in b) for b in buckets) * elem, src[buckets[0][0].src_buffer].device)
                for d, buckets in shm_out.items()}
    return ShmTransport(rank, group, outgoing, {s: len(buckets) for s, buckets in shm_in.items()})


def _post_sums(buckets: list[list[Transfer]], peer: int, elem: int, group) -> tuple:
    """Post the receive of `peer`'s block sums of all its buckets to this rank, in host memory."""
    want = torch.empty(sum(_n_sums(sum(t.numel for t in b) * elem) for b in buckets), dtype=torch.int64)
    return irecv(want, peer, control_of(group), TAG_SUMS), want


def _compare_checksums(rank: int, sent: dict[int, list[torch.Tensor]],
                       received: dict[int, list[tuple[list[Transfer], torch.Tensor]]], elem: int, group,
                       via_shm: Collection[int] = (), early: Mapping[int, tuple] | None = None) -> None:
    """The receiver compares each sender's block sums of its buckets with its own and raises naming the
    regions in the first differing block. `early`: peer -> (work, host tensor) of sums whose receive was
    posted at the start (`_post_sums`; their senders sent them as soon as they were computed); the others
    are exchanged here, each sender sending `sent`, on the device group in one batch. A device backend's
    peers through shared memory (`via_shm`) are always early: they share a device, which nccl does not span."""
    early = early or {}
    if not sent and not received:
        return
    mine = {s: torch.cat([sums for _, sums in got]) for s, got in received.items()}  # on the data's device
    mine.update({s: m.cpu() for s, m in mine.items() if s in early})
    want = {s: early[s][1] if s in early else torch.empty_like(m) for s, m in mine.items()}
    works = [early[s][0] for s in want if s in early]
    late = [*sent, *(s for s in want if s not in early)]
    if late:
        device = next(iter([*(mine[s] for s in want if s not in early), *(t for sums in sent.values() for t in sums)]))
        with _Batch(group, device.device, True) as batch:
            works += [batch.track(isend(torch.cat(sums), d, group)) for d, sums in sent.items()]
            works += [batch.track(irecv(w, s, group)) for s, w in want.items() if s not in early]
    for w in works:
        w.wait()
    first, blocks = None, 0
    for s, got in received.items():
        bad = (mine[s] != want[s]).nonzero().flatten()
        if bad.numel():
            blocks += bad.numel()
            first = first or (s, _regions_at(got, int(bad[0]), elem))
    if first:
        s, regions = first
        named = "; ".join(f"{t.param} region {t.box} in buffer {t.dst_buffer!r}" for t in regions[:4])
        more = f" and {len(regions) - 4} more" if len(regions) > 4 else ""
        raise ChecksumMismatch(
            f"weight sync: {named}{more} on rank {rank} differs from what rank {s} sent"
            f"{' through shared memory' if s in via_shm else ''} ({blocks} block(s) of 4 KiB differ); the "
            f"destination does not hold the trainer's weights")


def _regions_at(received: list[tuple[list[Transfer], torch.Tensor]], index: int, elem: int) -> list[Transfer]:
    """The transfers whose bytes lie in entry `index` of a peer's concatenated bucket checksums."""
    for bucket, sums in received:
        if index >= sums.numel():
            index -= sums.numel()
            continue
        lo, hi = _block_bytes(index, sum(t.numel for t in bucket) * elem)
        out, offset = [], 0
        for t in bucket:
            end = offset + t.numel * elem
            if offset < hi and end > lo:
                out.append(t)
            offset = end
        return out
    return []
