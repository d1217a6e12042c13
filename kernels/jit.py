"""Triton when it is installed, else a stand-in: the kernel modules define their kernels
either way (`@triton.jit` leaves them plain functions), and dispatchers launch them only
`if HAVE_TRITON`; the plain-torch references serve machines without it."""

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

__all__ = ["HAVE_TRITON", "tl", "triton"]
