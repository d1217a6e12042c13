"""The host heap of an engine on the CPU: glibc keeps what torch frees, for the next forward.

On the CPU every activation is a fresh host allocation. glibc serves each one of more
than 32 MiB (a prefill's MLP activations, gathered K/V) with an mmap of its own and
unmaps it at free, so the next forward faults the same memory in again, page by page,
each page zeroed by the kernel: a resumed All-Gather round at N = 10 on SmolLM2 took
~800 k page faults and ~3 s of system time. `keep()` sets glibc to serve every size
from its heap (no mmap), never to trim it, and to give every thread the one main arena
(the server's engine thread included), so a forward reuses what the last one freed: the
same round then faults ~50 k times (docs/benchmarks.md, "the host heap"). What tcmalloc
does for vLLM-CPU, with the C library at hand. The cost: the process keeps its peak heap
for the next peak, as a caching allocator does; `trim()` once the engine is built hands
back what loading the weights left free, so that peak is serving's, not loading's.

`frozen()` is for Python's own heap: a server serves inside it (vLLM's freezes it too).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator

import structlog

log = structlog.get_logger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
KEEP = ((M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1), (M_ARENA_MAX, 1))


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl and others lack it)
        return libc
    except (OSError, AttributeError):
        return None


def keep() -> bool:
    """Set glibc's malloc to keep freed memory in its heap; False where the C library is
    not glibc (nothing done) or refused a setting."""
    libc = _glibc()
    if libc is None:
        log.info("host heap left as it is", why="not glibc")
        return False
    done = all(libc.mallopt(param, value) == 1 for param, value in KEEP)
    if not done:
        log.warning("host heap: glibc refused a malloc setting")
    return done


def trim() -> None:
    """Hand the heap's free memory back to the system now (glibc's malloc_trim)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def frozen() -> Iterator[int]:
    """Put every Python object alive now (the model, its tokenizer, the engine's tables)
    out of the cyclic collector's reach while the block runs, and give how many: its full
    collections, which a burst of small objects (a scored prompt's logprobs) sets off,
    then walk only what came since (on the H200 a scored 16 k-token prefill took about a
    fifth less: docs/benchmarks.md). Unfrozen after, so that the process's exit still
    frees them (native bindings report what it does not free as leaks)."""
    gc.collect()
    gc.freeze()
    log.info("startup heap frozen for the garbage collector", objects=gc.get_freeze_count())
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()
