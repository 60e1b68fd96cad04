"""Keep freed CPU memory for the next training step (glibc malloc).

glibc gives every block over 32 MB its own mmap and unmaps it on free. A stacked expert bank's
gradient is one such block (OLMoE: 0.25 to 1 GB per bank), so under glibc's defaults every step
faults it in again, zero-filled by the kernel. On the VM we measured that runs at 0.4-0.8 GB/s and
made a full OLMoE-2L train step 1.5-5 s instead of 0.8 s. transformers' per-expert 4 MB gradients
escape this because glibc recycles small blocks from its heap. `keep_freed_memory()` makes glibc
treat big blocks the same way, which is what PyTorch's caching allocator does on a GPU.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameter numbers, from glibc's <malloc.h>
USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Serve every block from glibc's heap and never hand freed heap memory back to the kernel.

    Process-wide and permanent: the resident size stays at its high-water mark, which a training
    loop reaches again every step anyway. train.py and evaluate.py call this; call it yourself at
    the top of your own CPU training script. Returns False, changing nothing, when the C library is
    not glibc or when the environment already configures glibc's malloc (`MALLOC_*_`, `GLIBC_TUNABLES`).
    """
    if any(name in os.environ for name in USER_SETTINGS):
        return False
    libc = ctypes.CDLL(None)  # the symbols already loaded into this process, the C library among them
    if not hasattr(libc, "gnu_get_libc_version"):  # musl, macOS: their allocators have no such knobs
        return False
    # mallopt returns 1 on success. A trim threshold of -1 turns trimming off (mallopt(3)); the
    # value is a C int, so no byte count could say "never" for more than 2 GB of freed memory.
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
