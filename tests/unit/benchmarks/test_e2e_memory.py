"""The end-to-end benchmark's memory figure (benchmarks/e2e_bench.py): free pages in the kernel's per-CPU lists
are free, not used."""

import os

from benchmarks.e2e_bench import cpu_list_free_bytes

ZONEINFO = """Node 0, zone    DMA32
  pages free     100
  pagesets
    cpu: 0
              count:    280
              high:     1444
    cpu: 1
              count:    20
              high:     1444
Node 0, zone   Normal
  pagesets
    cpu: 0
              count:    700
"""


def test_per_cpu_list_pages_are_summed_over_zones_and_cpus(tmp_path):
    f = tmp_path / "zoneinfo"
    f.write_text(ZONEINFO)
    assert cpu_list_free_bytes(str(f)) == 1000 * os.sysconf("SC_PAGE_SIZE")
    assert cpu_list_free_bytes(str(tmp_path / "missing")) == 0
    assert cpu_list_free_bytes() >= 0  # this machine's own
