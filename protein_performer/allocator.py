"""Host memory reuse for training on a CPU.

PyTorch's CPU allocator is plain malloc. glibc serves every block above 32 MiB (its largest
mmap threshold) with a fresh mmap and unmaps it on free, and trims a freed block off its heap's
top, so a training step whose activations are that large (the L x r features FAVOR+ keeps for
its backward: 64 MiB per layer at 8 x 1,024 and r = 256) page-faults all of them in again every
step; on a 2-core VM that cost more than the attention's arithmetic (docs/benchmarks_training.md).
``keep_freed_memory`` tells glibc to serve large blocks from its heap and keep freed memory for
the next step, the in-process form of
``GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=...`` (and of what jemalloc /
tcmalloc preloading buys PyTorch on CPUs). The price: the process holds its peak heap until it
exits, as a CUDA caching allocator does, and the heap settles at a few copies of its largest
block before every request is served from freed memory (tests/test_allocator.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, glibc <malloc.h>
KEEP_BYTES = 2 ** 31 - 1  # mallopt takes an int: the largest trim threshold it accepts (2 GiB)
IS_GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Make glibc malloc keep and reuse freed memory instead of unmapping it (Linux / glibc only).
    Returns whether the setting was applied: False elsewhere (macOS, musl), where nothing changes."""
    if not IS_GLIBC:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # mallopt returns 1 on success, 0 on a rejected value
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
