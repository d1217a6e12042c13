"""Triton when it is installed, else a stand-in: the kernel modules define their kernels
either way (`@triton.jit` leaves them plain functions), and dispatchers launch them only
`if HAVE_TRITON` (and, for a head's kernels, `tiles_head`); the plain-torch references
serve machines without it."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # a CPU-only install still has the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn: fn)
    tl = None
    HAVE_TRITON = False


def tiles_head(d: int) -> bool:
    """Whether the Triton kernels that tile a head (attention, RoPE, the KV store) take
    head dim `d`: they split it in two halves of a power of two, each at least 16 wide
    (tl.dot's least). Other head dims run the plain-torch references, on a GPU too."""
    return HAVE_TRITON and d >= 32 and d & (d - 1) == 0


__all__ = ["HAVE_TRITON", "tiles_head", "tl", "triton"]
