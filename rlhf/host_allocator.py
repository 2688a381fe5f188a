"""The malloc a process on cpu starts with, chosen before it starts: the loader reads `LD_PRELOAD` and glibc its
tunables only at a process's start, so these are given to a Ray actor's `runtime_env`, never set inside it. Nothing
here imports torch or Ray (config checks ask whether jemalloc is there before anything starts).

A trainer process runs on jemalloc (`trainer.cpu_allocator`), which keeps the pages an update frees for its next
micro-batch, where glibc maps its large blocks afresh and faults their pages in again; an engine process runs on
glibc with transparent huge pages. What a process got: `rlhf.host_memory.process_allocator`; handing its free
pages back: `rlhf.host_memory.trim_heap`.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
from typing import Mapping

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"


def huge_page_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment an engine process on cpu starts with, and a trainer process on glibc's malloc: it asks for
    transparent huge pages on the memory it maps (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, glibc 2.35 and later;
    older ones ignore it). A co-located trainer hands its freed heap back at each offload
    (`rlhf.host_memory.trim_heap`) and faults it in again at the next update: 2 MiB at a time instead of 4 KiB, the
    update's page faults halve and the update on cpu takes 0.6-0.8 s less of 6-7 s. A sleeping engine hands back its weights and KV cache and refaults them at each sync and wake,
    the sync's staging buffers while the trainer updates: with huge pages the small run's step was 1.04-1.15x
    faster (docs/throughput.md). Tunables already in `environ` (this process's environment by
    default) are kept, and one that sets `glibc.malloc.hugetlb` itself wins."""
    environ = os.environ if environ is None else environ
    given = environ.get("GLIBC_TUNABLES", "")
    if any(part.split("=", 1)[0] == HUGE_PAGE_TUNABLE for part in given.split(":") if part):
        return {"GLIBC_TUNABLES": given}
    return {"GLIBC_TUNABLES": ":".join(p for p in (given, f"{HUGE_PAGE_TUNABLE}=1") if p)}


# jemalloc's settings in a trainer process on cpu: freed pages are kept for the next allocations however large (no
# decay, no separate arena for large blocks) and are transparent huge pages. An update frees and allocates the same
# activations every micro-batch; glibc maps the large ones afresh each time and faults their pages in again.
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1,thp:always,metadata_thp:auto"


def jemalloc_library() -> str | None:
    """A jemalloc to preload: the one Ray's wheel carries for its own daemons (`ray/core/libjemalloc.so`, jemalloc
    5.3 on Linux), else the system's (`libjemalloc.so.2`, by its soname), else None."""
    spec = importlib.util.find_spec("ray")  # where Ray is installed, without importing it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        bundled = os.path.join(root, "core", "libjemalloc.so")
        if os.path.isfile(bundled):
            return bundled
    return ctypes.util.find_library("jemalloc")


def allocator_env(allocator: str = "auto", environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a trainer process on cpu starts with (`trainer.cpu_allocator`; a Ray actor's
    `runtime_env`: the loader reads it when the process starts). `jemalloc`: the library preloaded with
    `JEMALLOC_CONF` (a `MALLOC_CONF` already in `environ` wins; libraries already preloaded stay, after it);
    `glibc`: glibc's malloc with huge pages (`huge_page_env`); `auto`: jemalloc where `jemalloc_library` finds
    one, else glibc. Raises `FileNotFoundError` for `jemalloc` without a library."""
    environ = os.environ if environ is None else environ
    if allocator not in ("auto", "jemalloc", "glibc"):
        raise ValueError(f"allocator {allocator!r}: auto, jemalloc or glibc")
    lib = jemalloc_library() if allocator != "glibc" else None
    if lib is None:
        if allocator == "jemalloc":
            raise FileNotFoundError("no jemalloc library: neither Ray's wheel (ray/core/libjemalloc.so) nor the "
                                    "system (libjemalloc.so.2) has one; install libjemalloc2 or use glibc")
        return huge_page_env(environ)
    preloaded = [p for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if p != lib]
    # glibc's tunables too: on a node whose Ray lies elsewhere the loader skips the library (saying so in the
    # actor's log) and the process keeps glibc's malloc, with huge pages
    return {"LD_PRELOAD": " ".join([lib, *preloaded]), "MALLOC_CONF": environ.get("MALLOC_CONF", JEMALLOC_CONF),
            **huge_page_env(environ)}


def allocator_name(env: Mapping[str, str]) -> str:
    """The malloc an `allocator_env` result starts a process on: "jemalloc" or "glibc"."""
    return "jemalloc" if "MALLOC_CONF" in env else "glibc"
