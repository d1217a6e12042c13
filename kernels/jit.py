"""Triton when it is installed, else a stand-in: the kernel modules define their kernels
either way (`@triton.jit` leaves them plain functions), and dispatchers launch them only
`if HAVE_TRITON` (and, for a head's kernels, `tiles_head`); the plain-torch references
serve machines without it. Beside that, how the kernels tile a head: the head dims they
take, each half's padded width, and the masks and offsets of the padding."""

from __future__ import annotations

from collections.abc import Callable, Iterable

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # a CPU-only install still has the references
    from types import SimpleNamespace

    triton = SimpleNamespace(jit=lambda fn: fn)
    tl = None
    HAVE_TRITON = False
try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # no Triton (nothing launches), or one that names it elsewhere
    class OutOfResources(Exception):
        pass


_FITS: dict[tuple, dict] = {}


def fitting(kind: tuple, cfg: dict, smaller: Iterable[dict], launch: Callable[[dict], None]) -> dict:
    """Launch with `cfg`, or where the GPU has not the shared memory it asks (Triton raises
    OutOfResources before anything runs) with it changed by each of `smaller` in turn; the
    configuration that launched is kept for launches of the same `kind` and `cfg`, which
    then try it alone. Returns it."""
    key = (*kind, *sorted(cfg.items()))
    if key in _FITS:
        launch(_FITS[key])
        return _FITS[key]
    tries = [cfg, *({**cfg, **x} for x in smaller)]
    for i, c in enumerate(tries):
        try:
            launch(c)
        except OutOfResources:
            if i == len(tries) - 1:
                raise
            continue
        _FITS[key] = c
        return c


def launch_options(c: dict) -> dict:
    """A launch configuration's options for Triton: warps, stages and, where `c` caps them,
    registers a thread (maxnreg; more warps stay resident, at the risk of spills)."""
    cap = {"maxnreg": c["maxnreg"]} if c.get("maxnreg") else {}
    return dict(num_warps=c["num_warps"], num_stages=c["num_stages"], **cap)


def tiles_head(d: int) -> bool:
    """Whether the Triton kernels that tile a head (attention, RoPE, the KV store) take
    head dim `d`: any even one from 16 to 256. They split it in two halves (RoPE's), each
    tiled as `padded_half(d)` columns, the ones past d/2 masked (`cols`) or reading the
    head's own again (`wrapped`). Other head dims run the plain-torch references, on a
    GPU too."""
    return HAVE_TRITON and d % 2 == 0 and 16 <= d <= 256


def padded_half(d: int) -> int:
    """The columns a kernel tiles half of head dim `d` with: a power of two (tl.arange's
    rule) of at least 16 (tl.dot's least)."""
    return max(16, 1 << (d // 2 - 1).bit_length())


@triton.jit
def cols(n: tl.constexpr, live: tl.constexpr, PAD: tl.constexpr):
    """A mask of the first `live` of a tile's n columns: `arange < live` with PAD, else a
    constant that folds away (the tile is exactly the head's width)."""
    if PAD:
        m = tl.arange(0, n) < live
    else:
        m = tl.full([n], 1, tl.int1)
    return m


@triton.jit
def wrapped(n: tl.constexpr, live: tl.constexpr, PAD: tl.constexpr):
    """A tile's n column offsets, the ones past `live` wrapped onto live ones with PAD: a
    load through them stays in its row and reads finite values, and needs no mask where
    what those columns meet is zero (a query's padding) or is never stored."""
    offs = tl.arange(0, n)
    if PAD:
        offs = offs % live
    return offs


@triton.jit
def in_heads(i, stride, HALF: tl.constexpr):
    """i * stride (i a scalar, a vector or a column; stride a multiple of a head's 2 * HALF
    columns), marked as a multiple of the largest power of two that divides 2 * HALF.
    Triton's launcher marks a stride divisible by 16 itself; at head dim 120 nothing said
    that 8 divides its strides, and every load through them read 2 bytes at a time,
    unpipelined (bench/ptx.py). The mark must sit on the product made here: Triton drops
    it on a function's argument. The hosts check the claim (`head_strides`); where 16
    divides the head it adds nothing."""
    x = i * stride
    if (2 * HALF) % 16 != 0:
        a: tl.constexpr = (2 * HALF) & -(2 * HALF)
        if len(x.shape) == 2:
            x = tl.multiple_of(x, [a, a])
        else:
            x = tl.multiple_of(x, a)
    return x


def head_strides(d: int, *strides: int) -> bool:
    """Whether every stride is a multiple of what `in_heads` tells the compiler at head dim d."""
    return d % 16 == 0 or all(s % (d & -d) == 0 for s in strides)


__all__ = ["HAVE_TRITON", "cols", "head_strides", "in_heads", "wrapped", "padded_half", "tiles_head",
           "tl", "triton"]
