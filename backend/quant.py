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

Block-wise scales (`weight_block_size`, the FP8 checkpoints transformers writes), weights
alone in 8 bits (W8A16) and integer or 4-bit formats are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tokendance.backend.api import InvalidRequest
from tokendance.backend.start import DRAW, Linear
from tokendance.kernels.fp8_linear import Fp8Linear, fits

# A checkpoint's scales beside its weights: a weight row's, an input's, and the KV cache's
# (`kv_cache_scheme`; the pool scales its own 8-bit KV, backend/config.py kv_cache_dtype)
SCALES = (".weight_scale", ".input_scale")
KV_SCALES = (".k_scale", ".v_scale", ".kv_scale")


@dataclass(frozen=True, slots=True)
class Quant:
    method: str  # vLLM's name: fp8 or compressed-tensors
    stored: bool  # the checkpoint holds e4m3 weights; else each row is rounded on loading
    static: bool = False  # inputs rounded under the checkpoint's input_scale, not per row


def parse(q: Any, path: str) -> Quant | None:
    """A config.json's `quantization_config` (None: none); InvalidRequest naming what is not
    supported."""
    if q is None:
        return None
    if not isinstance(q, dict):
        raise InvalidRequest(f"{path}: quantization_config is not an object", "model")
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("weight_block_size"):
            raise _refuse(path, f"block-wise fp8 scales (weight_block_size {q['weight_block_size']})")
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse(path, f"fp8 activation_scheme {scheme!r}")
        return Quant("fp8", True, scheme == "static")
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise InvalidRequest(f"{path}: compressed-tensors quantization_config has no config_groups", "model")
        static = {_group(name, g, q.get("format"), path) for name, g in groups.items()}
        if len(static) > 1:
            raise _refuse(path, "groups with static and dynamic input scales together")
        return Quant("compressed-tensors", True, static.pop())
    raise _refuse(path, f"quantization method {method!r}")


def _group(name: str, g: Any, fmt: Any, path: str) -> bool:
    """Whether a compressed-tensors group's inputs take a static scale; refuses all but
    8-bit float weights per channel or per tensor with 8-bit float inputs."""
    g = g if isinstance(g, dict) else {}
    w, a = g.get("weights"), g.get("input_activations")
    w = w if isinstance(w, dict) else {}
    fmt = g.get("format") or fmt
    if fmt != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(path, f"group {name}: format {fmt!r}, {w.get('num_bits')}-bit {w.get('type')} weights")
    if w.get("strategy") not in ("channel", "tensor"):
        raise _refuse(path, f"group {name}: weight scales per {w.get('strategy')}")
    if not isinstance(a, dict):
        raise _refuse(path, f"group {name}: 8-bit weights with wide inputs (W8A16)")
    if a.get("type", "float") != "float" or a.get("num_bits") != 8:
        raise _refuse(path, f"group {name}: {a.get('num_bits')}-bit {a.get('type')} inputs")
    if a.get("dynamic") is True and a.get("strategy") == "token":
        return False
    if a.get("dynamic") is False and a.get("strategy") == "tensor":
        return True
    raise _refuse(path, f"group {name}: input scales per {a.get('strategy')}, dynamic {a.get('dynamic')}")


def _refuse(path: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"{path}: {what} is not supported; this engine serves 8-bit float weights with "
                          "a scale per channel or per tensor (fp8, compressed-tensors float-quantized) "
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
    """A projection as the model holds it: in e4m3 where quantized and its widths allow."""
    if quant is not None and fits(n_in, n_out):
        return Fp8Linear(n_in, n_out, bias, quant.static, start=DRAW.get())
    return Linear(n_in, n_out, bias=bias)
