"""Freed memory handed back to the system.

Tensors smaller than glibc's mmap threshold (which grows to 32 MiB as large blocks are freed)
live on the C heap, and a freed one stays in the process: its pages count in the RSS until the
heap's top is trimmed. Work that makes and drops many such tensors before the memory that matters
(the self-check's units one after another, a rank's build that draws the values of every
parameter it does not hold) calls `release_freed_memory` after it.
"""

from __future__ import annotations


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's `malloc_trim`; nothing
    elsewhere)."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None
