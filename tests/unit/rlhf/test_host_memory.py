"""Host memory handed back between phases (rlhf/host_memory.py): anonymous buffers and released pages."""

import os

import pytest
import torch

from rlhf.host_memory import AnonymousBuffers, heap_free_bytes, release_pages, trim_heap


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_buffers_are_zeros_of_their_shapes_and_do_not_overlap():
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 2, 2)}
    bufs = AnonymousBuffers(shapes, torch.float32)
    assert {n: tuple(t.shape) for n, t in bufs.items()} == shapes
    assert all(t.dtype == torch.float32 and not t.any() for t in bufs.values())
    for i, t in enumerate(bufs.values()):
        t.fill_(i + 1)
    assert [set(t.unique().tolist()) for t in bufs.values()] == [{1.0}, {2.0}, {3.0}]
    assert all(t.data_ptr() % 64 == 0 for t in bufs.values())


def test_release_gives_memory_back_and_reads_as_zeros_in_the_same_tensors():
    n = 16 << 20  # 64 MiB of float32
    bufs = AnonymousBuffers({"w": (n,), "padding": (4, 1024)}, torch.float32)
    w, views = bufs["w"], bufs["w"][::1024]
    before = _rss()
    w.fill_(2.5)
    bufs["padding"].fill_(1.0)
    touched = _rss()
    assert touched - before > 60 << 20
    bufs.release()
    assert touched - _rss() > 60 << 20  # the pages went back
    assert bufs["w"] is w and not w.any() and not bufs["padding"].any()  # same tensors, zeros again
    w[:2048].copy_(torch.arange(2048, dtype=torch.float32))  # a view made before sees the next sync's writes
    assert views[:3].tolist() == [0.0, 1024.0, 0.0]


def test_packed_buffers_lie_back_to_back():
    bufs = AnonymousBuffers({"a": (3,), "b": (5, 1), "c": (2,)}, torch.float32, packed=True)
    assert [t.data_ptr() - bufs["a"].data_ptr() for t in bufs.values()] == [0, 12, 32]


def test_bfloat16_and_empty():
    bufs = AnonymousBuffers({"x": (3, 3)}, torch.bfloat16)
    assert bufs["x"].dtype == torch.bfloat16 and not bufs["x"].any()
    empty = AnonymousBuffers({}, torch.float32)
    assert dict(empty) == {}
    empty.release()


def test_release_pages_of_torch_tensors():
    n = 16 << 20  # 64 MiB of float32 from torch's own allocator
    t, small = torch.full((n,), 3.0), torch.full((100,), 7.0)
    touched = _rss()
    released = release_pages([t, t.view(4, -1).t(), small, None])  # a permuted view of all of t: released once
    assert touched - _rss() > 60 << 20 and n * 4 - 2 * 4096 <= released <= n * 4
    page_floats = 4096 // 4
    # the pages wholly inside the storage read as zeros; the partial pages at its ends keep their values
    assert not t[page_floats:-page_floats].any()
    assert t[:1].item() in (0.0, 3.0) and t[-1:].item() in (0.0, 3.0)
    assert small.eq(7.0).all()  # within one page: nothing released
    t.fill_(1.5)  # written again: faulted in, the values are kept
    assert t.eq(1.5).all() and _rss() - touched > -(8 << 20)
    assert release_pages([]) == 0


def test_release_pages_of_part_of_a_buffer_keeps_the_rest():
    bufs = AnonymousBuffers({"a": (3000,), "b": (5000,), "c": (3000,)}, torch.float32)
    for i, t in enumerate(bufs.values()):
        t.fill_(i + 1)
    released = release_pages([bufs["b"]])  # 20,000 bytes: the pages wholly inside b
    assert released >= 20000 - 2 * 4096 and released % 4096 == 0
    assert bufs["a"].eq(1).all() and bufs["c"].eq(3).all()  # its neighbours, edge pages shared with b included
    assert bufs["b"].eq(0).any() and set(bufs["b"].unique().tolist()) <= {0.0, 2.0}
    with pytest.raises(ValueError, match="strided view"):
        release_pages([torch.zeros(64, 64)[:, :8]])


def test_trim_heap_gives_back_what_glibc_keeps_free_only_above_the_threshold():
    keep = [torch.ones(1 << 14) for _ in range(8000)]  # 8,000 x 64 KiB: below any mmap threshold, from the heap
    del keep[::2]  # half of them freed in the middle of the heap: glibc keeps those pages
    free = heap_free_bytes()
    assert free is not None and free >= 200 << 20
    assert not trim_heap(at_least=free * 4)  # below the threshold: left alone
    before = _rss()
    assert trim_heap(at_least=1 << 20)
    assert before - _rss() > 100 << 20 and heap_free_bytes() is not None


def test_onednn_cache_capped_unless_the_environment_says_otherwise(monkeypatch):
    from rlhf.host_memory import ONEDNN_CACHE_CAPACITY, small_onednn_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    small_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")  # a user's own choice stands
    small_onednn_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_advised() -> bool:
    try:
        with open(THP) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def test_huge_page_env_adds_the_tunable_and_keeps_the_users():
    from rlhf.host_allocator import huge_page_env

    assert huge_page_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    off = "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"  # a user's own choice stands
    assert huge_page_env({"GLIBC_TUNABLES": off}) == {"GLIBC_TUNABLES": off}


@pytest.mark.skipif(not _thp_advised(), reason=f"the kernel offers no transparent huge pages ({THP})")
def test_huge_page_buffers_are_advised_and_still_release():
    n = 8 << 20  # 32 MiB of float32
    plain = AnonymousBuffers({"w": (n,)}, torch.float32)
    huge = AnonymousBuffers({"w": (n,)}, torch.float32, huge_pages=True)
    assert "hg" not in _vm_flags(plain["w"].data_ptr())
    assert "hg" in _vm_flags(huge["w"].data_ptr())  # MADV_HUGEPAGE on the mapping
    w = huge["w"]
    w.fill_(1.5)
    touched = _rss()
    huge.release()
    assert touched - _rss() > 28 << 20 and not w.any()


@pytest.mark.skipif(not _thp_advised(), reason=f"the kernel offers no transparent huge pages ({THP})")
def test_a_process_started_with_huge_page_env_maps_its_heap_with_huge_pages():
    """What a trainer process on cpu starts with: glibc's malloc advises huge pages on the large blocks it maps
    (a glibc before 2.35 ignores the tunable: skipped there)."""
    import subprocess
    import sys

    from rlhf.host_allocator import huge_page_env

    if tuple(int(x) for x in os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2]) < (2, 35):
        pytest.skip("glibc.malloc.hugetlb needs glibc 2.35 or later")
    probe = ("import sys; sys.path.insert(0, %r); import torch; from tests.unit.rlhf.test_host_memory import _vm_flags;"
             "t = torch.ones(64 << 20, dtype=torch.uint8); print('hg' in _vm_flags(t.data_ptr()))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def advised(env: dict) -> bool:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | env
        out = subprocess.run([sys.executable, "-c", probe % root], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() == "True"

    assert advised(huge_page_env({}))
    assert not advised({})


def test_allocator_env_preloads_jemalloc_or_falls_back_to_glibc_huge_pages(monkeypatch):
    import rlhf.host_allocator as hm

    monkeypatch.setattr(hm, "jemalloc_library", lambda: "/lib/libjemalloc.so")
    # glibc's huge pages too, for a node where the loader cannot find the library
    assert hm.allocator_env("auto", {}) == {"LD_PRELOAD": "/lib/libjemalloc.so", "MALLOC_CONF": hm.JEMALLOC_CONF,
                                            "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    # a user's own MALLOC_CONF wins; libraries already preloaded stay, after it, once
    assert hm.allocator_env("jemalloc", {"MALLOC_CONF": "narenas:1", "LD_PRELOAD": "/lib/a.so:/lib/libjemalloc.so"}) \
        == {"LD_PRELOAD": "/lib/libjemalloc.so /lib/a.so", "MALLOC_CONF": "narenas:1",
            "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert hm.allocator_name(hm.allocator_env("auto", {})) == "jemalloc"
    assert hm.allocator_env("glibc", {}) == hm.huge_page_env({})
    assert hm.allocator_name(hm.allocator_env("glibc", {})) == "glibc"
    monkeypatch.setattr(hm, "jemalloc_library", lambda: None)
    assert hm.allocator_env("auto", {}) == hm.huge_page_env({})
    with pytest.raises(FileNotFoundError, match="libjemalloc"):
        hm.allocator_env("jemalloc", {})
    with pytest.raises(ValueError, match="auto, jemalloc or glibc"):
        hm.allocator_env("tcmalloc", {})


def test_a_process_started_on_jemalloc_keeps_freed_pages_until_trimmed():
    """What a trainer process on cpu starts with (`allocator_env("jemalloc")`): freed blocks, large ones included,
    stay resident for the next allocations (no page faults for them), `heap_free_bytes` counts them and
    `trim_heap` hands them back (a co-located trainer's offload)."""
    import json
    import subprocess
    import sys

    from rlhf.host_allocator import allocator_env, jemalloc_library

    if jemalloc_library() is None:
        pytest.skip("no jemalloc library here (Ray's wheel carries ray/core/libjemalloc.so on Linux)")
    probe = """
import json, sys; sys.path.insert(0, %r)
import torch
from rlhf.host_memory import heap_free_bytes, process_allocator, trim_heap
def rss(): return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) << 10
out = {"allocator": process_allocator()}
small = [torch.ones(1 << 14) for _ in range(4000)]  # 4,000 x 64 KiB
big = torch.ones(200 << 20, dtype=torch.uint8)  # one 200 MiB block
del small[::2], big
out["free"], out["rss"] = heap_free_bytes(), rss()
again = torch.ones(200 << 20, dtype=torch.uint8)  # the same pages again: resident memory does not grow
out["rss_again"] = rss()
del again
out["below"] = trim_heap(at_least=1 << 40)
out["trimmed"], out["rss_trimmed"], out["free_trimmed"] = trim_heap(at_least=1 << 20), rss(), heap_free_bytes()
print(json.dumps(out))
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_CONF", "LD_PRELOAD")} | allocator_env("jemalloc", {})
    run = subprocess.run([sys.executable, "-c", probe % root], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["allocator"].startswith("jemalloc ")
    assert out["free"] >= (200 << 20) + 100 * (64 << 10)  # the big block and the freed small ones, kept
    assert out["rss_again"] - out["rss"] < 16 << 20
    assert not out["below"] and out["trimmed"]
    assert out["rss"] - out["rss_trimmed"] > 200 << 20 and out["free_trimmed"] < 16 << 20


def test_this_process_runs_on_glibc():
    from rlhf.host_memory import process_allocator

    assert process_allocator() == "glibc"
