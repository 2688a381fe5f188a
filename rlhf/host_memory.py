"""Host memory handed back to the operating system between the phases that need it.

Freed host tensors rarely leave a process: glibc keeps their pages for its next allocations, so a role's
resident memory stays at its peak through the phases where another co-located role peaks. Three tools here:

- `AnonymousBuffers`: named tensors in one private anonymous mapping; `release()` drops its pages
  (`madvise(MADV_DONTNEED)`) and the next write faults in fresh zero pages. After a release they read as zeros,
  exactly as freshly allocated buffers do, and the tensor objects stay the same (views made earlier stay valid).
  An engine worker on cpu receives a sync into such staging buffers (vLLM serves from processed copies of its
  weights, so a sync cannot write into them) and releases them after each install, and at once when its own
  receive is rejected (a worker whose peer worker rejected keeps its pages until its next install): otherwise
  they were a second copy of the engine's weights held through the trainer's update (0.56 GB per engine of the
  140 M-parameter small model in fp32). The trainer keeps its gradients in one on cpu (`rlhf.parallel.grads`),
  released after each update and when it offloads (between steps nothing reads them; a step starts from zeros).
- `release_pages`: the same for memory torch allocated: an engine asleep on cpu (`VLLMEngine.sleep`) hands
  back its KV cache, and at level 2 its weights once the sync that overwrites them starts to arrive; the
  direct install hands back each layer's staged buffers as soon as it has copied them.
- `trim_heap`: the allocator's own free pages (the trainer's freed activations), handed back at its offload.

Which allocator a process runs on is chosen before it starts (`rlhf.host_allocator`); `process_allocator` says which
one it got. And one setting that keeps memory from being held at all: `small_onednn_cache`, for the trainer's bf16
matmuls.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from typing import Iterable, Mapping

import torch

_ALIGN = 64  # bytes: every buffer starts on a cache line


class AnonymousBuffers(dict):
    """name -> tensor of the given shape and dtype, all in one anonymous mapping, zeros at first, in the given
    order, each starting on a cache line (`packed`: right after the one before it, no gap between them).
    `huge_pages`: the mapping asks the kernel for transparent huge pages (`madvise(MADV_HUGEPAGE)`), so that
    refilling it after each release faults 2 MiB at a time instead of 4 KiB (where the kernel's THP setting is
    `madvise` or `always`; a no-op under `never`)."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, packed: bool = False,
                 huge_pages: bool = False):
        item = torch.empty((), dtype=dtype).element_size()
        align = item if packed else _ALIGN
        sizes = {name: math.prod(shape) * item for name, shape in shapes.items()}
        starts, total = {}, 0
        for name, n in sizes.items():
            starts[name], total = total, total + -(-n // align) * align
        # private: MADV_DONTNEED frees the pages (a shared mapping would keep them in shmem, and its contents)
        self._map = mmap.mmap(-1, max(total, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        super().__init__({name: raw[starts[name]:starts[name] + sizes[name]].view(dtype).view(shape)
                          for name, shape in shapes.items()})

    def release(self) -> None:
        """Give the pages back: resident memory drops by the buffers' size; they read as zeros afterwards."""
        self._map.madvise(mmap.MADV_DONTNEED)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def release_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Give back the pages lying wholly inside each cpu tensor's memory (`madvise(MADV_DONTNEED)`); returns their
    bytes. Private anonymous memory, which torch's cpu allocator and `AnonymousBuffers` hand out, reads as zeros
    afterwards and is faulted in again by the next write: only for tensors whose every element is written before
    it is read again (a KV cache between generations, weights a sync overwrites, staged buffers once installed).
    A tensor's memory is its own bytes when it is contiguous (a view into a larger buffer releases only its part),
    or its whole storage when it spans all of it in another order (vLLM's permuted KV cache views); any other
    strided view is refused. The partial pages at either end keep their contents; a range is released once."""
    seen, total, page = set(), 0, mmap.PAGESIZE
    for t in tensors:
        if t is None or t.device.type != "cpu":
            continue
        nbytes, storage = t.numel() * t.element_size(), t.untyped_storage()
        if t.is_contiguous():
            start = t.data_ptr()
        elif nbytes == storage.nbytes():
            start = storage.data_ptr()
        else:
            raise ValueError(f"release_pages: a strided view ({tuple(t.shape)}, strides {t.stride()}) of part of "
                             "its storage; its pages hold other tensors' elements")
        lo, hi = -(-start // page) * page, (start + nbytes) // page * page
        if (lo, hi) in seen or hi <= lo:
            continue
        seen.add((lo, hi))
        if _libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED):
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) of {hi - lo} bytes: {os.strerror(err)}")
        total += hi - lo
    return total


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_free_bytes() -> int | None:
    """Bytes the process's allocator holds free for later allocations: under jemalloc (`rlhf.host_allocator`) its dirty
    and muzzy pages over every arena, under glibc its heaps' free bytes (`mallinfo2().fordblks`, every arena); None
    where neither can say (another C library, a glibc older than 2.33, a jemalloc built without statistics)."""
    if _mallctl is not None:
        try:
            _jemalloc_write("epoch", ctypes.c_uint64(1))  # refresh jemalloc's statistics
            pages = sum(_jemalloc_read(f"stats.arenas.{_ARENAS_ALL}.{kind}", ctypes.c_size_t)
                        for kind in ("pdirty", "pmuzzy"))
        except OSError:  # a jemalloc built without statistics
            return None
        return pages * _jemalloc_read("arenas.page", ctypes.c_size_t)
    info = getattr(_libc, "mallinfo2", None)
    if info is None:
        return None
    info.restype = _Mallinfo2
    return int(info().fordblks)


def trim_heap(at_least: int = 64 << 20) -> bool:
    """Hand the allocator's free pages back to the system when it holds at least `at_least` bytes of them (the
    next allocations fault them in again, so a small heap is left alone): jemalloc purges every arena, glibc
    runs `malloc_trim(0)`. Whether it trimmed."""
    free = heap_free_bytes()
    if free is None or free < at_least:
        return False
    if _mallctl is not None:
        _jemalloc_write(f"arena.{_ARENAS_ALL}.purge", None)
        return True
    trim = getattr(_libc, "malloc_trim", None)
    return trim is not None and bool(trim(0))


# jemalloc, where a process starts with it (`rlhf.host_allocator`): its control interface, found in the process's own
# symbols (glibc has none)
_mallctl = getattr(_libc, "mallctl", None)
if _mallctl is not None:
    _mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                         ctypes.c_size_t]
_ARENAS_ALL = 4096  # MALLCTL_ARENAS_ALL: the statistics and purge of every arena


def _jemalloc_read(name: str, ctype):
    value, size = ctype(), ctypes.c_size_t(ctypes.sizeof(ctype))
    if _mallctl(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0):
        raise OSError(f"jemalloc's mallctl({name!r}) failed")
    return value.value


def _jemalloc_write(name: str, value) -> None:
    new, size = (None, 0) if value is None else (ctypes.byref(value), ctypes.sizeof(value))
    if _mallctl(name.encode(), None, None, new, size):
        raise OSError(f"jemalloc's mallctl({name!r}) failed")


def process_allocator() -> str:
    """The allocator serving this process's malloc: "jemalloc <version>" or "glibc"."""
    if _mallctl is None:
        return "glibc"
    return "jemalloc " + _jemalloc_read("version", ctypes.c_char_p).decode().split("-")[0]


ONEDNN_CACHE_CAPACITY = 256  # oneDNN primitives a trainer process keeps (oneDNN's own default: 1,024)


def small_onednn_cache(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive cache at `capacity` unless the environment already sets it
    (ONEDNN_PRIMITIVE_CACHE_CAPACITY, read when the process makes its first primitive: call this before any
    matmul). On cpu torch runs bf16 matmuls through oneDNN, which builds a primitive per shape: an update makes
    one for each micro-batch's token count in every projection, forward and backward, and one per expert group
    size (padded to `EXPERT_ROWS_MULTIPLE`). A cap below the step's count misses on every call and rebuilds each
    primitive, which costs more than the matmul; a cap far above it lets the shapes of later steps' micro-batches
    pile up. fp32 matmuls go to BLAS, untouched. The count, and the update's time and memory at several caps:
    docs/throughput.md ("The update")."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(capacity))
