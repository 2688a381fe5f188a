"""A receiver's staging buffers, handed back to the operating system between syncs.

An engine on cpu receives a sync into staging buffers (vLLM serves from processed copies of its weights, so a
sync cannot write into them) and installs from there. Kept from sync to sync, the buffers are a second full
copy of the engine's weights resident for the whole run, through the trainer's update, when the co-located
roles' memory peaks (0.56 GB per engine of the 140 M-parameter small model in fp32). Here they live in one
anonymous memory mapping: `release()` drops its pages (`madvise(MADV_DONTNEED)`), and the next write faults in
fresh zero pages. So between syncs they hold no memory, after a release they read as zeros, exactly as freshly
allocated buffers do (rows that no transfer covers, such as vocabulary padding, must be zeros), and the tensor
objects stay the same, so the receive's cached destination views (`weight_sync.p2p._DstRegions`) stay valid.
The engine worker releases them after each install, and at once when its own receive is rejected (a worker
whose peer worker rejected keeps its pages until its next install).
"""

from __future__ import annotations

import math
import mmap
from typing import Mapping

import torch

_ALIGN = 64  # bytes: every buffer starts on a cache line


class StagingBuffers(dict):
    """name -> tensor of the given shape and dtype, all in one anonymous mapping, zeros at first."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype):
        item = torch.empty((), dtype=dtype).element_size()
        sizes = {name: math.prod(shape) * item for name, shape in shapes.items()}
        starts, total = {}, 0
        for name, n in sizes.items():
            starts[name], total = total, total + -(-n // _ALIGN) * _ALIGN
        # private: MADV_DONTNEED frees the pages (a shared mapping would keep them in shmem, and its contents)
        self._map = mmap.mmap(-1, max(total, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        super().__init__({name: raw[starts[name]:starts[name] + sizes[name]].view(dtype).view(shape)
                          for name, shape in shapes.items()})

    def release(self) -> None:
        """Give the pages back: resident memory drops by the buffers' size; they read as zeros afterwards."""
        self._map.madvise(mmap.MADV_DONTNEED)
