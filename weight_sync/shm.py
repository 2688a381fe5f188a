"""Shared memory between plan ranks on one device: the transport `run_plan(..., same_device=...)` uses
for co-located roles in different processes (a trainer rank and an engine host), in place of the
process group. Only tiny control messages go through the group (its gloo side, `control_of`, on devices); the
bytes go through a mapped segment.

Per (sender, receiver) pair the sender owns one segment of two slots, each at least the pair's
largest bucket (rounded up to 4 KiB). Bucket r goes in slot r % 2: the sender packs it and sends
`ready r`; the receiver copies the slot into its destination buffers and sends `done r`, which frees
the slot for bucket r + 2. So the sender packs r + 1 while the receiver copies r out, as the
point-to-point path keeps two rounds alive. The messages are int64 tensors on tag 1 (sender ->
receiver) and tag 2 (receiver -> sender), never mixed with the data on tag 0 or the checksums on tag 3:

    receiver: hello [id of the segment it still maps from this sender, or 0]
    sender:   header [id, bytes, kind, payload bytes], then the payload (the name, or an IPC handle)
              when the receiver does not map that segment yet; sent with `ready 0`, bucket 0 having been
              packed meanwhile into the segment kept from the last sync (moved to a new one if the hello
              says the receiver no longer maps it)
    sender:   ready [r]           receiver: done [r]          (per bucket)

Segments outlive a sync: a fresh /dev/shm segment costs page faults worth several copies of it (about
60 ms per 64 MiB on our CPU machine, against 8 ms to copy 64 MiB once it is mapped). Each process keeps
its last segment per (peer, direction) (`_HELD`, at most two slots of the largest bucket per peer)
and both sides reuse it while the ids agree; the hello gives a restarted peer a new one.
`release_segments()` drops them. A sync that fails drops this process's segments for its peers.

CPU: a file in /dev/shm named `rlhf-ws-<pid>-<id>`, reserved with posix_fallocate (a full /dev/shm
raises ENOSPC here, not SIGBUS on first touch) and mapped MAP_SHARED. The receiver unlinks the name as
soon as it has mapped it and the sender when the sync ends, failed or not: no name stays in /dev/shm,
and the memory lives exactly as long as the two mappings (it goes with the processes if they die).

CUDA / NPU: the slots are a device tensor shared by IPC handle (`torch.multiprocessing.reductions.
reduce_tensor` and its rebuild function; torch_npu patches reduce_tensor for NPU tensors), with a
device synchronize before each `ready` / `done`. Run on one CUDA GPU (two ranks on it, nccl for data, gloo
for control: tests/dist/test_device_weight_sync.py, skipped without a GPU); NPU not run.
"""

from __future__ import annotations

import mmap
import os
import pickle
import secrets
from typing import Collection, Mapping

import torch

from weight_sync.group import control_of, irecv, isend

SHM_DIR = "/dev/shm"
NAME_PREFIX = "rlhf-ws-"
_ALIGN = 4096
_TAG_FORWARD, _TAG_BACK = 1, 2  # sender -> receiver, receiver -> sender; tag 0 carries data, tag 3 checksums
_KIND_FILE, _KIND_IPC = 1, 2


def pair_set(same_device: Collection[tuple[int, int]] | None) -> frozenset[tuple[int, int]]:
    """The declared pairs in both orders: sharing a device is symmetric, and transfers may go either way."""
    out = set()
    for pair in same_device or ():
        if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(r, int) and r >= 0 for r in pair)):
            raise ValueError(f"same_device entry {pair!r}: give (rank, rank) tuples of two plan ranks")
        a, b = pair
        if a == b:
            raise ValueError(f"same_device entry {pair!r}: a rank with itself; the plan already makes a rank's "
                             f"own transfers local copies, list pairs of different ranks")
        out |= {(a, b), (b, a)}
    return frozenset(out)


class Segment:
    """Bytes mapped in this process and shared with one peer: `data` (uint8, on its device), `id` (what
    both sides call it), `path` (its /dev/shm name while still linked; None once unlinked or for IPC)."""

    def __init__(self, seg_id: int, data: torch.Tensor, path: str | None = None):
        self.id, self.data, self.path = seg_id, data, path

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def slot(self, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `nbytes` of bucket r's slot, as a flat tensor of `dtype`."""
        base = (r % 2) * (self.nbytes // 2)
        return self.data[base:base + nbytes].view(dtype)

    def unlink(self) -> None:
        if self.path is not None:
            _unlink(self.path)
            self.path = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:  # the other side got there first
        pass


def remove_segments_of(pid: int) -> list[str]:
    """Remove the segments a process of this node created and never unlinked (it was killed mid-sync)."""
    import glob

    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{NAME_PREFIX}{int(pid)}-*")):
        _unlink(path)
        removed.append(os.path.basename(path))
    return removed


def segment_bytes(largest_bucket: int) -> int:
    """Two slots, each the largest bucket rounded up to 4 KiB (slot offsets stay aligned for every dtype)."""
    return 2 * max(_ALIGN, -(-largest_bucket // _ALIGN) * _ALIGN)


def create_segment(nbytes: int, device: torch.device) -> tuple[Segment, int, bytes]:
    """A new segment of `nbytes` on `device`, with what the peer needs to map it: (segment, kind, payload)."""
    seg_id = secrets.randbits(62) + 1
    if device.type == "cpu":
        name = f"{NAME_PREFIX}{os.getpid()}-{seg_id:x}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise OSError(e.errno, f"weight sync: cannot reserve {nbytes} bytes of shared memory in {SHM_DIR} "
                                       f"({e.strerror}); free space there or lower bucket_bytes") from e
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return Segment(seg_id, torch.frombuffer(mapped, dtype=torch.uint8), path), _KIND_FILE, name.encode()
    if device.type in ("cuda", "npu"):  # run on CUDA, not on NPU (see the module docstring)
        from torch.multiprocessing.reductions import reduce_tensor

        data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return Segment(seg_id, data), _KIND_IPC, pickle.dumps(reduce_tensor(data))
    raise ValueError(f"weight sync: no shared-memory path for {device.type} buffers; declare no same_device "
                     f"pairs for them (cpu, cuda and npu have one)")


def open_segment(seg_id: int, nbytes: int, kind: int, payload: bytes) -> Segment:
    """Map the peer's segment described by a header and its payload."""
    if kind == _KIND_FILE:
        name = payload.decode()
        if not name.startswith(NAME_PREFIX) or "/" in name:
            raise ValueError(f"weight sync: {name!r} is not a weight-sync shared-memory segment")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        _unlink(path)  # both sides map it now: the name can go
        return Segment(seg_id, torch.frombuffer(mapped, dtype=torch.uint8))
    if kind == _KIND_IPC:  # run on CUDA, not on NPU; the payload comes from a rank of this job
        rebuild, args = pickle.loads(payload)
        return Segment(seg_id, rebuild(*args))
    raise ValueError(f"weight sync: unknown shared-memory kind {kind}")


_HELD: dict[tuple[str, int, int], Segment] = {}  # ("send" | "recv", rank, peer) -> segment kept across syncs


def held_segments() -> dict[tuple[str, int, int], int]:
    """("send" | "recv", rank, peer) -> id of each segment this process keeps mapped."""
    return {k: s.id for k, s in _HELD.items()}


def release_segments() -> None:
    """Unmap every kept segment (each is freed once its peer drops it too)."""
    _HELD.clear()


def _sync_device(data: torch.Tensor) -> None:
    if data.device.type != "cpu":  # the copies into / out of IPC memory must land before the message
        getattr(torch, data.device.type).synchronize(data.device)


class ShmTransport:
    """This rank's shared-memory channels for one sync. `outgoing`: peer -> (largest bucket bytes, device
    of the source buffers); `incoming`: peer -> number of buckets it sends here. Use as a context manager:
    entering posts the hellos, leaving unlinks what this sync created (and, on an error, drops the
    kept segments of these peers so the next sync starts afresh)."""

    def __init__(self, rank: int, group, outgoing: Mapping[int, tuple[int, torch.device]],
                 incoming: Mapping[int, int]):
        self.rank, self.group = rank, control_of(group)  # host int64 messages: the gloo side
        self.outgoing, self.incoming = dict(outgoing), dict(incoming)
        self._works: list = []  # (work, tensor) of messages sent, waited at the end
        self._hello: dict[int, tuple] = {}
        self._header: dict[int, tuple] = {}
        self._ready: dict[int, tuple] = {}
        self._done: dict[int, list] = {p: [] for p in self.outgoing}
        self._send: dict[int, Segment] = {}
        self._first_bytes: dict[int, int] = {}  # bucket 0's bytes per outgoing peer (moved if the peer lost our segment)
        self._payload: dict[int, tuple[int, bytes]] = {}  # (kind, payload) of a segment created this sync, per peer
        self._recv: dict[int, Segment] = {}
        self._created: list[Segment] = []

    def __enter__(self) -> "ShmTransport":
        for s in self.incoming:
            held = _HELD.get(("recv", self.rank, s))
            self._message(torch.tensor([held.id if held else 0], dtype=torch.int64), s, _TAG_BACK)
            self._header[s] = self._post_recv(4, s, _TAG_FORWARD)
        for d in self.outgoing:
            self._hello[d] = self._post_recv(1, d, _TAG_BACK)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for seg in self._created:
            seg.unlink()
        if exc_type is not None:
            for d in self.outgoing:
                _HELD.pop(("send", self.rank, d), None)
            for s in self.incoming:
                _HELD.pop(("recv", self.rank, s), None)

    # --- sender side ---
    def slot(self, peer: int, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bucket r's slot for `peer`, once free (for r >= 2: after the peer's `done r - 2`). Bucket 0 is
        packed into the segment kept from the last sync with this peer without waiting for its hello (a
        receiver that starts later does not hold the packing up); `ready 0` reads the hello."""
        if r == 0:
            self._open_send(peer, nbytes)
        elif r >= 2:
            self._expect(self._done[peer].pop(0), r - 2, peer, "done")
        return self._send[peer].slot(r, nbytes, dtype)

    def ready(self, peer: int, r: int) -> None:
        if r == 0:
            self._confirm_send(peer)
        _sync_device(self._send[peer].data)
        self._message(torch.tensor([r], dtype=torch.int64), peer, _TAG_FORWARD)
        self._done[peer].append(self._post_recv(1, peer, _TAG_BACK))

    def _open_send(self, peer: int, first_bytes: int) -> None:
        largest, device = self.outgoing[peer]
        seg = _HELD.get(("send", self.rank, peer))
        if seg is None or seg.nbytes < segment_bytes(largest) or seg.data.device != device:
            seg = self._new_send_segment(peer)
        self._send[peer], self._first_bytes[peer] = seg, first_bytes

    def _confirm_send(self, peer: int) -> None:
        """The peer's hello names the segment it still maps from us: the kept one is reused only if it is that
        one; otherwise (a restarted peer) bucket 0 moves into a new segment, whose name the header carries."""
        held_by_peer = self._wait(self._hello.pop(peer))[0]
        seg = self._send[peer]
        if seg.id != held_by_peer and seg not in self._created:
            n = self._first_bytes[peer]
            new = self._new_send_segment(peer)
            new.data[:n].copy_(seg.data[:n])
            self._send[peer] = seg = new
        if seg in self._created:
            kind, payload = self._payload[peer]
            self._message(torch.tensor([seg.id, seg.nbytes, kind, len(payload)], dtype=torch.int64), peer,
                          _TAG_FORWARD)
            self._message(torch.frombuffer(bytearray(payload), dtype=torch.uint8), peer, _TAG_FORWARD)
        else:
            self._message(torch.tensor([seg.id, seg.nbytes, 0, 0], dtype=torch.int64), peer, _TAG_FORWARD)

    def _new_send_segment(self, peer: int) -> Segment:
        largest, device = self.outgoing[peer]
        _HELD.pop(("send", self.rank, peer), None)
        seg, kind, payload = create_segment(segment_bytes(largest), device)
        self._created.append(seg)
        _HELD[("send", self.rank, peer)] = seg
        self._payload[peer] = (kind, payload)
        return seg

    # --- receiver side ---
    def wait(self, peer: int, r: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        """Bucket r from `peer`, once it is in its slot."""
        if r == 0:
            self._start_receiving(peer)
            self._ready[peer] = self._post_recv(1, peer, _TAG_FORWARD)
        self._expect(self._ready.pop(peer), r, peer, "ready")
        if r + 1 < self.incoming[peer]:  # post the next one ahead; never past the last bucket, or it would
            self._ready[peer] = self._post_recv(1, peer, _TAG_FORWARD)  # take the next sync's first message
        seg = self._recv[peer]
        if nbytes > seg.nbytes // 2:
            raise RuntimeError(f"weight sync: bucket {r} from rank {peer} to rank {self.rank} has {nbytes} bytes, "
                               f"more than the shared slot ({seg.nbytes // 2}); the two ranks run different plans")
        return seg.slot(r, nbytes, dtype)

    def done(self, peer: int, r: int) -> None:
        _sync_device(self._recv[peer].data)
        self._message(torch.tensor([r], dtype=torch.int64), peer, _TAG_BACK)

    def _start_receiving(self, peer: int) -> None:
        seg_id, nbytes, kind, payload_len = self._wait(self._header.pop(peer))
        key = ("recv", self.rank, peer)
        if payload_len == 0:
            seg = _HELD.get(key)
            if seg is None or seg.id != seg_id:
                raise RuntimeError(f"weight sync: rank {peer} reuses shared segment {seg_id:x}, which rank "
                                   f"{self.rank} does not map; the two ranks disagree on their segments")
        else:
            _HELD.pop(key, None)
            payload = torch.empty(payload_len, dtype=torch.uint8)
            irecv(payload, peer, self.group, _TAG_FORWARD).wait()
            seg = _HELD[key] = open_segment(seg_id, nbytes, kind, payload.numpy().tobytes())
        self._recv[peer] = seg

    # --- both ---
    def finish(self) -> None:
        """Wait for the last `done` of every outgoing peer and for every message sent."""
        for peer, pending in self._done.items():
            while pending:
                self._wait(pending.pop(0))
        for work, _ in self._works:
            work.wait()
        self._works.clear()

    def _message(self, t: torch.Tensor, peer: int, tag: int) -> None:
        self._works.append((isend(t, peer, self.group, tag), t))

    def _post_recv(self, n: int, peer: int, tag: int) -> tuple:
        buf = torch.empty(n, dtype=torch.int64)
        return irecv(buf, peer, self.group, tag), buf

    @staticmethod
    def _wait(posted: tuple) -> list[int]:
        work, buf = posted
        work.wait()
        return buf.tolist()

    def _expect(self, posted: tuple, r: int, peer: int, what: str) -> None:
        got = self._wait(posted)[0]
        if got != r:
            raise RuntimeError(f"weight sync: rank {self.rank} expected {what} {r} from rank {peer} over shared "
                               f"memory, got {got}; the two ranks run different plans")
