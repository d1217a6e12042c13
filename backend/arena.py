"""Host pages for the host tier: one buffer pinned when the tier is made, reused for its
lifetime.

Pinning host memory is slow and stalls the thread that asks: on the H200's host a fresh
24 MiB pinned tensor took 18 ms (median of 8, up to 338 ms) against 4 µs for one the
allocator had cached. A fresh pinned tensor for every parked agent put that stall on the
engine's step loop at every park (in short tool turns `collective` took 1.15-1.21x
`full`'s round, docs/benchmarks.md). So the tier pins its whole budget once, when the
engine starts, as vLLM's and LMCache's CPU tiers do, and a park pays only its copy.

The buffer is pages of `page` rows of [layers, 2, Hkv, D] (one token's K/V in every
layer). An entry is a few runs of consecutive pages, handed out lowest first; each run is
one contiguous range, one copy. Copies are queued on the current stream (non-blocking on
CUDA), so pages freed and handed out again are safe in stream order; read a page on the
CPU only after torch.cuda.synchronize().
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

PAGE_BYTES = 2 << 20  # a copy of 2 MiB runs near the host link's rate (53 of 55 GB/s)


@dataclass(slots=True)
class Pages:
    """An entry's pages: runs of (first page, pages), ascending, holding `n` rows."""

    runs: list[tuple[int, int]]
    n: int


class Arena:
    """`capacity` bytes of pages of `page` rows of shape `row` (default: 2 MiB a page)."""

    def __init__(self, row: tuple[int, ...], dtype: torch.dtype, pin: bool, capacity: int,
                 page: int | None = None):
        self.row = row
        row_bytes = dtype.itemsize
        for d in row:
            row_bytes *= d
        self.page = page or max(1, PAGE_BYTES // row_bytes)
        self.page_bytes = self.page * row_bytes
        if 0 < capacity < self.page_bytes:  # it would hold nothing, and say so nowhere
            raise ValueError(f"host tier: {capacity:,} bytes hold not one page ({self.page_bytes:,} bytes, "
                             f"{self.page} tokens' K/V); give it at least that, or 0 to turn it off "
                             "(offload_bytes, --offload-gib)")
        self.capacity = capacity // self.page_bytes  # in pages
        try:
            self.data = torch.empty((self.capacity * self.page, *row), dtype=dtype, pin_memory=pin)
        except RuntimeError as e:
            raise MemoryError(f"host tier: cannot {'pin' if pin else 'allocate'} "
                              f"{capacity / 2**30:.2f} GiB of host memory ({e}); "
                              f"give it less (offload_bytes, --offload-gib)") from None
        self.free: list[list[int]] = [[0, self.capacity]] if self.capacity else []  # [start, end)
        self.free_pages = self.capacity

    def pages(self, n: int) -> int:
        """Pages `n` rows take."""
        return -(-n // self.page)

    def alloc(self, n: int) -> Pages:
        """Pages for `n` rows, lowest first; MemoryError when too few are free (the
        caller keeps within the capacity)."""
        k = self.pages(n)
        if k > self.free_pages:
            raise MemoryError(f"host arena: {k} pages asked, {self.free_pages} of {self.capacity} free")
        runs, need = [], k
        while need:
            lo, hi = self.free[0]
            take = min(need, hi - lo)
            runs.append((lo, take))
            need -= take
            if take == hi - lo:
                self.free.pop(0)
            else:
                self.free[0][0] += take
        self.free_pages -= k
        return Pages(runs, n)

    def release(self, p: Pages) -> None:
        for lo, k in p.runs:
            hi = lo + k
            i = bisect.bisect_left(self.free, lo, key=lambda r: r[0])
            if i and self.free[i - 1][1] == lo:  # joins the run before it
                i -= 1
                self.free[i][1] = hi
            else:
                self.free.insert(i, [lo, hi])
            if i + 1 < len(self.free) and self.free[i + 1][0] == hi:  # and the one after
                self.free[i][1] = self.free.pop(i + 1)[1]
            self.free_pages += k
        p.runs = []

    def write(self, p: Pages, src: torch.Tensor) -> None:
        """Copy `src` [n, *row] into the entry's pages."""
        at = 0
        for view in self._views(p):
            view.copy_(src[at:at + view.shape[0]], non_blocking=True)
            at += view.shape[0]

    def read(self, p: Pages, dst: torch.Tensor) -> None:
        """Copy the entry's rows into `dst` [n, *row]."""
        at = 0
        for view in self._views(p):
            dst[at:at + view.shape[0]].copy_(view, non_blocking=True)
            at += view.shape[0]

    def _views(self, p: Pages):
        left = p.n
        for lo, k in p.runs:
            rows = min(left, k * self.page)
            yield self.data[lo * self.page:lo * self.page + rows]
            left -= rows
