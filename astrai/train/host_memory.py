"""Peak host memory of CPU training: make freed tensors go back to the system.

glibc's malloc serves a request above its mmap threshold from a fresh mapping, returned to the system
when freed; below it, from the heap, which keeps freed memory and reuses it only for requests that
fit the holes. The threshold is dynamic: it starts at 128 KiB and rises to the size of every mapped
block freed, up to 32 MiB. A training step frees blocks of tens of MiB within its first layers, so
the rest of the step's activations and gradients (a few MiB each) come from the heap, whose holes do
not fit later tensors of other sizes: the peak grows by the fragmentation, not only by the tensors.

`return_freed_memory(threshold)` fixes the threshold (which also stops the dynamic rise) with
mallopt(M_MMAP_THRESHOLD): every tensor of `threshold` bytes or more gets a mapping of its own,
unmapped when it is freed. The price is time: each such tensor starts on fresh pages the kernel must
zero. So the train option `return_freed_memory` is off by default, for a run that does not fit in
memory otherwise (peaks and step times on SmolLM2: bench/RESULTS.md, `bench/finetune.py
--memory-only` and `--freed-timing`). A no-op returning False where the C library has no such call
(macOS) or refuses it (musl's mallopt does nothing and returns 0).
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 256 * 1024  # a [1024, 64] float32 tensor; smaller objects stay on the heap


def return_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Serve every allocation of `threshold` bytes or more from its own mapping (glibc). True if set."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
