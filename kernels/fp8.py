"""K/V held in 8 bits (vLLM's `--kv-cache-dtype fp8`): half the pool's bytes a token, so
twice the tokens in the same memory, and half the bytes a decode step reads.

A value is stored as vLLM stores it by default (a scale of 1): saturated at the format's
largest finite number, then rounded to the nearest representable one; a reader casts it
back up to its compute dtype. Every kernel that reads a pool takes it in either width;
those that write one narrow with `narrow` (Triton: `tl.clamp` by `limit`, then the
store's cast). torch's CPU kernels do not index 8-bit floats in place (index_copy_,
gather), so copies between pools move their bytes (`as_bytes`).
"""

from __future__ import annotations

import torch

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def limit(dtype: torch.dtype) -> float:
    """The largest finite value of `dtype` (0.0 for a dtype that needs no saturation)."""
    return float(torch.finfo(dtype).max) if is_fp8(dtype) else 0.0


def narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a pool of `dtype` holds it: saturated into 8 bits first, where it is 8 bits."""
    if is_fp8(dtype):
        m = limit(dtype)
        return x.clamp(-m, m).to(dtype)
    return x.to(dtype)


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A pool's values read in the compute dtype `dtype` where they are 8 bits (exact: every
    8-bit value is one of float16's, bfloat16's and float32's), others as they are."""
    return t.to(dtype) if is_fp8(t.dtype) else t


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit float tensor as its bytes (a view), others as they are: for the index
    copies torch's CPU kernels lack for 8-bit floats."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t
