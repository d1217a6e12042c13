"""The weights' quantization: what a checkpoint's `quantization_config` says and what
`--quantization` asks for, settled once into the projections the model is built with.

8-bit float projections (kernels/fp8_linear.py: e4m3 weights with a scale per output row,
inputs rounded per row or under a checkpoint's static scale) come two ways, as in vLLM:

- `--quantization fp8` over a wide checkpoint: each weight row rounded as it is read
  (backend/place.py), the wide model never built;
- a checkpoint stored in e4m3 with its scales: vLLM's `fp8` (AutoFP8's, a scale per tensor)
  and `compressed-tensors` float-quantized (llm-compressor's FP8 and FP8-dynamic: a scale
  per tensor or per channel; `tokendance quantize` writes the latter, backend/checkpoint.py).
  Its bytes and scales are placed as they are.
- block-wise: a scale per bn x bk block of the weight, inputs rounded per group of bk
  columns (kernels/fp8_block.py): `fp8` with `weight_block_size` (Qwen3's and DeepSeek's FP8
  checkpoints, transformers' FineGrainedFP8) and compressed-tensors' `block` strategy
  (llm-compressor's FP8_BLOCK).

Weights alone in 8 bits (W8A16) and integer or 4-bit formats are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tokendance.backend.api import InvalidRequest
from tokendance.backend.start import DRAW, Linear
from tokendance.kernels.fp8_block import BlockFp8Linear
from tokendance.kernels.fp8_linear import Fp8Linear, fits

# A checkpoint's scales beside its weights: a weight row's, an input's, and the KV cache's
# (`kv_cache_scheme`; the pool scales its own 8-bit KV, backend/config.py kv_cache_dtype)
SCALES = (".weight_scale", ".weight_scale_inv", ".input_scale")  # _inv: the fp8 block format's name
KV_SCALES = (".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True, slots=True)
class Quant:
    method: str  # vLLM's name: fp8 or compressed-tensors
    stored: bool  # the checkpoint holds e4m3 weights; else each row is rounded on loading
    static: bool = False  # inputs rounded under the checkpoint's input_scale, not per row
    block: tuple[int, int] | None = None  # (bn, bk): a weight scale per block, inputs per group of bk


def parse(q: Any, path: str) -> Quant | None:
    """A config.json's `quantization_config` (None: none); InvalidRequest naming what is not
    supported."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise InvalidRequest(f"{path}: quantization_config is not an object", "model")
    method = q.get("quant_method")
    if method == "fp8":
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse(path, f"fp8 activation_scheme {scheme!r}")
        block = _block(q.get("weight_block_size"), "weight_block_size", path)
        if block is not None and scheme == "static":
            raise _refuse(path, "block-wise weights with static input scales")
        return Quant("fp8", True, scheme == "static", block)
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise InvalidRequest(f"{path}: compressed-tensors quantization_config has no config_groups", "model")
        kinds = {_group(name, g, q.get("format"), path) for name, g in groups.items()}
        if len(kinds) > 1:
            raise _refuse(path, "groups of different schemes together (" +
                          ", ".join(sorted("block-wise" if b else "static" if s else "dynamic" for s, b in kinds)) + ")")
        static, block = kinds.pop()
        return Quant("compressed-tensors", True, static, block)
    raise _refuse(path, f"quantization method {method!r}")


def block_side(v: Any) -> bool:
    """Whether `v` can be a side of a block of weights: a power of two of 16 or more (the
    Triton product's tiles)."""
    return type(v) is int and v >= 16 and v & (v - 1) == 0


def _block(size: Any, field: str, path: str) -> tuple[int, int] | None:
    """A block's (rows, columns) as a checkpoint gives them (`block_side`s), or none."""
    if size is None:
        return None
    if not isinstance(size, list) or len(size) != 2 or not all(block_side(v) for v in size):
        raise _refuse(path, f"{field} {size!r} (blocks of two powers of two, 16 or more, are)")
    return size[0], size[1]


def _group(name: str, g: Any, fmt: Any, path: str) -> tuple[bool, tuple[int, int] | None]:
    """Whether a compressed-tensors group's inputs take a static scale, and its weights'
    blocks; refuses all but 8-bit float weights per channel, tensor or block with 8-bit
    float inputs (per token or tensor; per group of a block's columns)."""
    g = g if isinstance(g, dict) else {}
    w, a = g.get("weights"), g.get("input_activations")
    w = w if isinstance(w, dict) else {}
    fmt = g.get("format") or fmt
    if fmt != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(path, f"group {name}: format {fmt!r}, {w.get('num_bits')}-bit {w.get('type')} weights")
    if w.get("strategy") not in ("channel", "tensor", "block"):
        raise _refuse(path, f"group {name}: weight scales per {w.get('strategy')}")
    if not isinstance(a, dict):
        raise _refuse(path, f"group {name}: 8-bit weights with wide inputs (W8A16)")
    if a.get("type", "float") != "float" or a.get("num_bits") != 8:
        raise _refuse(path, f"group {name}: {a.get('num_bits')}-bit {a.get('type')} inputs")
    if w.get("strategy") == "block":
        block = _block(w.get("block_structure"), f"group {name}: block_structure", path)
        if a.get("dynamic") is True and a.get("strategy") == "group" and a.get("group_size") == block[1]:
            return False, block
        raise _refuse(path, f"group {name}: block-wise weights with input scales per {a.get('strategy')} "
                            f"(group_size {a.get('group_size')}), dynamic {a.get('dynamic')}")
    if a.get("dynamic") is True and a.get("strategy") == "token":
        return False, None
    if a.get("dynamic") is False and a.get("strategy") == "tensor":
        return True, None
    raise _refuse(path, f"group {name}: input scales per {a.get('strategy')}, dynamic {a.get('dynamic')}")


def _refuse(path: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{path}: {what} is not supported; this engine serves 8-bit float weights with "
                          "a scale per channel, tensor or block (fp8, compressed-tensors float-quantized) "
                          "and rounds a wide checkpoint with --quantization fp8", "model")


def choose(given: str | None, stored: Quant | None, path: str) -> Quant | None:
    """The server's quantization: the checkpoint's, which `given` (--quantization) may name
    but not change (as vLLM: a mismatch is an error), or `given` over a wide checkpoint."""
    if stored is not None:
        if given not in (None, stored.method):
            raise InvalidRequest(f"--quantization {given}, but {path} says {stored.method}: leave the flag "
                                 f"out or give {stored.method}", "quantization")
        return stored
    if given == "compressed-tensors":
        raise InvalidRequest(f"--quantization compressed-tensors needs a checkpoint quantized so; {path} has "
                             "no quantization_config (--quantization fp8 rounds a wide one)", "quantization")
    return None if given is None else Quant(given, False)


def linear(quant: Quant | None, n_in: int, n_out: int, bias: bool) -> nn.Module:
    """A projection as the model holds it: in e4m3 where quantized and its widths allow
    (block-wise: whole blocks)."""
    if quant is not None and quant.block is not None:
        if n_out % quant.block[0] == 0 and n_in % quant.block[1] == 0:
            return BlockFp8Linear(n_in, n_out, quant.block, bias, start=DRAW.get())
    elif quant is not None and fits(n_in, n_out):
        return Fp8Linear(n_in, n_out, bias, quant.static, start=DRAW.get())
    return Linear(n_in, n_out, bias=bias)
