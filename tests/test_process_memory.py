"""keep_freed_memory: a freed big block is reused, not faulted in again (glibc only)."""
import json
import mmap
import os
import platform
import subprocess
import sys

import pytest

from minimoe.process_memory import KERNEL_CACHES

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Page faults while filling a fresh 64 MB tensor (16,384 pages of 4 KB), twenty times in a row.
# Under glibc 2.36 the heap still grows for the first few repeats (up to six seen): torch asks for
# 64-byte-aligned memory, and memalign wants a free chunk slightly bigger than the one just freed.
PROBE = """
import json, resource, sys, torch
from minimoe.process_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults_to_fill_a_fresh_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 * 2**20)  # 64 MB of float32, above glibc's largest mmap threshold (32 MB)
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": [faults_to_fill_a_fresh_block() for _ in range(20)]}))
"""


def probe(mode, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = probe("default"), probe("keep")
    assert min(default["faults"]) > 15_000, default  # glibc's default: every block is a fresh mmap
    assert kept["applied"] is True
    assert kept["faults"][0] > 15_000 and max(kept["faults"][-8:]) < 500, kept


def test_an_allocator_setting_in_the_environment_wins():
    kept = probe("keep", MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="0")
    assert kept["applied"] is False
    assert min(kept["faults"]) > 15_000, kept  # the user's trim threshold of 0 still applies


def thp_mode() -> str:
    try:  # e.g. "always [madvise] never": the bracketed word is the mode
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages summed over the mappings that overlap [start, end), from /proc/self/smaps
    (madvise splits a mapping where the advised range begins and ends)."""
    total, overlaps = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            overlaps = lo < end and start < hi
        elif overlaps and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason="this kernel gives no transparent huge pages")
def test_advised_tensor_is_backed_by_huge_pages_and_keeps_its_values():
    from minimoe.process_memory import HUGE_PAGE, advise_huge_pages
    import torch
    # 16 MB of float32 in a fresh mapping of its own: not torch.empty, which after an in-process train.py
    # (keep_freed_memory: every block from glibc's heap) reuses heap pages already faulted in
    block = torch.frombuffer(mmap.mmap(-1, 8 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.float32)
    advise_huge_pages(block)
    block.copy_(torch.arange(block.numel(), dtype=torch.float32))
    assert anon_huge_bytes(block.data_ptr(), block.data_ptr() + block.nbytes) >= 7 * HUGE_PAGE  # the whole pages inside
    assert torch.equal(block[:5], torch.arange(5.0)) and block[-1].item() == block.numel() - 1


# RSS growth over bf16 matrix products of 160 row counts (one compiled oneDNN kernel each), in GiB.
KERNELS = """
import json, sys, torch
from pathlib import Path
from minimoe.process_memory import keep_freed_memory, limit_kernel_cache
keep_freed_memory()
applied = limit_kernel_cache(int(sys.argv[1])) if sys.argv[1] != "default" else None
def rss():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024 / 2**30
w, x = torch.randn(576, 576, dtype=torch.bfloat16), torch.randn(256, 576, dtype=torch.bfloat16)
first = torch.nn.functional.linear(x[:63], w)
before = rss()
for rows in range(64, 224):
    torch.nn.functional.linear(x[:rows], w)
again = torch.nn.functional.linear(x[:63], w)  # its kernel evicted and compiled again when limited
print(json.dumps({"applied": applied, "growth": rss() - before, "same": bool(torch.equal(first, again))}))
"""


def kernels(mode, **env):
    clean = {k: v for k, v in os.environ.items() if k not in KERNEL_CACHES}
    out = subprocess.run([sys.executable, "-c", KERNELS, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_limit_kernel_cache_bounds_the_compiled_kernels_memory():
    from minimoe.runs.device import cpu_capabilities, native_bf16
    if not native_bf16(cpu_capabilities()):
        pytest.skip("no native bf16 on this CPU: its matrix products compile no oneDNN kernels per shape")
    default, limited = kernels("default"), kernels("16")
    assert limited["applied"] is True
    assert default["growth"] > 0.06, default  # 160 kernels of 0.5-1 MB kept
    assert limited["growth"] < default["growth"] / 3, (default, limited)
    assert default["same"] and limited["same"]  # a recompiled kernel gives the same bits


def test_a_kernel_cache_setting_in_the_environment_wins():
    for name in KERNEL_CACHES:
        assert kernels("16", **{name: "1024"})["applied"] is False
