"""keep_freed_memory: a freed big block is reused, not faulted in again (glibc only)."""
import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Faults while filling a fresh 256 MB tensor (65,536 pages of 4 KB), eight times in a row. Under
# glibc 2.36 the first few repeats may still extend the heap: torch asks for 64-byte aligned
# memory, and memalign wants a free chunk slightly bigger than the block freed just before.
PROBE = """
import json, resource, sys, torch
from minimoe.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults_to_fill_a_fresh_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(64 * 2**20)  # 256 MB of float32
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults = [faults_to_fill_a_fresh_block() for _ in range(8)]
print(json.dumps({"applied": applied, "first": faults[0], "again": faults[4:]}))
"""


def probe(mode, **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    default, kept = probe("default"), probe("keep")
    assert min(default["again"]) > 60_000, default  # glibc's default: each block is a new mmap
    assert kept["applied"] is True
    assert kept["first"] > 60_000 and max(kept["again"]) < 1_000, kept


def test_an_allocator_setting_in_the_environment_wins():
    kept = probe("keep", MALLOC_ARENA_MAX="2", MALLOC_TRIM_THRESHOLD_="0")
    assert kept["applied"] is False
    assert min(kept["again"]) > 60_000, kept  # the user's trim threshold of 0 still applies
