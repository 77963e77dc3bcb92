"""Give the C allocator's free memory back to the kernel after a burst of work.

CPython asks glibc's malloc for its objects' memory (pymalloc's 256 KiB arenas, and
every block over 512 bytes). After a burst that allocated much and kept little (the
start's lease list parsed at once, a netlink dump of every peer's three entries, read
back and dropped once diffed), glibc keeps the freed pages for later use: in the
agent at 5,000 peers, 2-4 MiB that no object uses any more. ``malloc_trim(0)`` hands
the free pages back (under 1 ms here at that size). Elsewhere than glibc (musl, macOS)
this is a no-op: the agent runs on glibc, as the Debian image does.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

# A pass or a batch that handled at least this many entries frees enough for a trim to
# pay; under it the allocator's slack is a few pages at most.
BULK_ENTRIES = 1000


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none. Looked up among the
    symbols the interpreter is linked with (``dlopen(NULL)``): no search for the library."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_free_memory() -> bool:
    """Return the allocator's free pages to the kernel; True if the C library could."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def after_bulk(entries: int) -> bool:
    """:func:`release_free_memory` after work on ``entries`` entries, if that is bulk
    (:data:`BULK_ENTRIES`); True if it ran."""
    return entries >= BULK_ENTRIES and release_free_memory()
