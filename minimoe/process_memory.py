"""CPU memory behaviour that PyTorch leaves to the C library and the kernel: platform tuning that
the CLIs (train.py, evaluate.py, bench/) and the loader call; `minimoe` does not export it.

keep_freed_memory(): keep freed blocks for the next training step (glibc malloc). glibc gives every
block over 32 MB its own mmap and unmaps it on free. A stacked expert bank's gradient is one such
block (OLMoE: 0.25 to 1 GB per bank), so under glibc's defaults every step faults it in again,
zero-filled by the kernel. `keep_freed_memory()` makes glibc serve big blocks from its heap as it
does small ones, which is what PyTorch's caching allocator does on a GPU.

limit_kernel_cache(): bound oneDNN's cache of compiled CPU kernels. Its bf16 matrix products (and
the attention's) compile one kernel per matrix shape and keep up to 1024 of them, 0.5 to 1 MB each;
each batch of new length brings a dozen new shapes, so over the default run the cache grew to the
largest holder of memory after the weights (bench/RESULTS.md, "peak memory").

advise_huge_pages(tensor): back a fresh tensor with 2 MB pages (Linux transparent huge pages).
Filling fresh memory costs one page fault per 4 KB page; 2 MB pages take 512x fewer, at the same
peak RSS. The measurements behind both are in bench/RESULTS.md.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # mallopt parameter numbers, from glibc's <malloc.h>
MADV_HUGEPAGE, HUGE_PAGE = 14, 2 * 2**20  # from Linux's <sys/mman.h>; x86-64 and arm64 (4 KB base pages)
# oneDNN's cache of compiled kernels, and the cache of ideep (PyTorch's oneDNN wrapper) that holds
# them too: each is read once, at its first use; ideep's crashes at 0 (torch 2.13).
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE = 256  # kernels kept: a training step's shapes, forward and backward, fit (bench/RESULTS.md)
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@functools.cache
def libc() -> ctypes.CDLL:
    """The symbols already loaded into this process, the C library among them (looked up once)."""
    return ctypes.CDLL(None)


def keep_freed_memory() -> bool:
    """Serve every block from glibc's heap and never hand freed heap memory back to the kernel.

    Process-wide and permanent: the resident size stays at its high-water mark, which a training
    loop reaches again every step anyway. train.py and evaluate.py call this; call it yourself at
    the top of your own CPU training script. Returns False, changing nothing, when the C library is
    not glibc or when the environment already configures glibc's malloc (`MALLOC_*_`, `GLIBC_TUNABLES`).
    """
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    if not hasattr(libc(), "gnu_get_libc_version"):  # musl, macOS: their allocators have no such knobs
        return False
    # mallopt returns 1 on success. A trim threshold of -1 turns trimming off (mallopt(3)); the
    # value is a C int, so no byte count could say "never" for more than 2 GB of freed memory.
    global _KEEPING
    _KEEPING = bool(libc().mallopt(M_MMAP_MAX, 0)) and bool(libc().mallopt(M_TRIM_THRESHOLD, -1))
    return _KEEPING


_KEEPING = False  # keep_freed_memory() took effect in this process


@contextlib.contextmanager
def mapped_big_blocks(threshold: int = 2**20):
    """Within: blocks of `threshold` bytes or more get their own mmap again, unmapped when freed, as
    before keep_freed_memory() (a no-op if it did not take effect). For packing a model as it loads
    (loading/checkpoint.py, --quantize): each matrix's transients are freed while its small packed
    tensors stay, so on a heap that is never trimmed the transients stop fitting the holes the packed
    tensors split, and the heap grew by about twice the checkpoint (measured, docs/quantization.md)."""
    if not _KEEPING:
        yield
        return
    libc().mallopt(M_MMAP_THRESHOLD, threshold)
    libc().mallopt(M_MMAP_MAX, 2**16)
    try:
        yield
    finally:
        libc().mallopt(M_MMAP_MAX, 0)


def limit_kernel_cache(capacity: int = KERNEL_CACHE) -> bool:
    """Keep at most `capacity` >= 1 compiled oneDNN kernels (default 1024), least recently used first out.

    Process-wide; takes effect only if called before the process's first oneDNN kernel (the first
    bf16 matrix product on a CPU), so call it at the top of your script, as train.py and evaluate.py
    do. A kernel evicted and needed again is compiled again: results are the same bits. Returns
    False, changing nothing, when the environment already sets either cache's size (KERNEL_CACHES).
    """
    if capacity < 1:
        raise ValueError(f"limit_kernel_cache: capacity={capacity}; expected >= 1 (ideep's cache crashes at 0)")
    if any(name in os.environ for name in KERNEL_CACHES):
        return False
    for name in KERNEL_CACHES:
        os.environ[name] = str(capacity)
    return True


def advise_huge_pages(tensor) -> None:
    """Advise Linux to back a fresh CPU tensor with 2 MB pages before it is first written.

    Only the whole 2 MB pages inside the tensor are advised, so no page is shared with other data.
    Advice only: a no-op off Linux, for tensors not on the CPU, for tensors under 4 MB, and where
    the kernel refuses (THP "never", or a kernel without THP).
    """
    if sys.platform != "linux" or tensor.device.type != "cpu" or tensor.nbytes < 2 * HUGE_PAGE:
        return
    first = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE  # round the start up, the end down
    end = (tensor.data_ptr() + tensor.nbytes) // HUGE_PAGE * HUGE_PAGE
    libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), MADV_HUGEPAGE)
