"""A GGUF file as an HF folder, once, in the cache directory (backend/loader.py `resolve`):
its config and tokenizer read by transformers' GGUF reader, with what that reader leaves
out of the config read from the file itself, and its weights streamed into the folder's
model.safetensors (backend/gguf_tensors.py), so that the folder's model is the one the
file holds.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from tokendance.backend import gguf_tensors
from tokendance.backend.api import InvalidRequest

log = structlog.get_logger(__name__)

VERSION = 2  # convert_gguf's: 2 fills in what transformers' GGUF reader leaves out
# llama.cpp's architectures that transformers reads from a GGUF and the server runs (its
# Mistral is "llama", and so is its Mixtral, a "llama" with experts, which transformers would
# read as a dense Llama: its config is made Mixtral's here)
GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2", "gemma3")
# GGUF metadata transformers' reader leaves unread (its GGUF_CONFIG_MAPPING), by
# architecture: the key less "{arch}." -> the config field. Without them the model would
# take its config class's defaults: Qwen3's head_dim of 128, Gemma 2's caps of 50 and 30...
UNREAD = {
    "qwen3": {"attention.key_length": "head_dim"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "phi3": {"attention.sliding_window": "sliding_window",
             "rope.scaling.original_context_length": "original_max_position_embeddings"},
}


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantize a GGUF into an HF folder once; atomic, so a crash leaves no half folder."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    reader = read(gguf)
    meta, factors = header(reader, gguf.name)
    log.info("converting gguf", src=str(gguf), dst=str(out))
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull), _parsed_once(gguf, reader):
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            fields = cfg.to_dict()
            fields.update(_unread(meta, factors, fields))
            cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)  # Mixtral's where _unread says
    except InvalidRequest:
        raise
    except Exception as e:  # transformers': metadata it cannot read, ...
        raise InvalidRequest(f"{gguf.name}: transformers cannot convert it ({type(e).__name__}: "
                             f"{first_line(e)})", "model") from e
    try:
        tmp.mkdir(parents=True)
        gguf_tensors.write(reader, meta["arch"], cfg.to_dict(), tmp)
        cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
        cfg.dtype = torch.float32  # the weights', as transformers writes a model's
        cfg.save_pretrained(tmp)
        GenerationConfig.from_model_config(cfg).save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except InvalidRequest as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise InvalidRequest(f"{gguf.name}: {e.message}", e.param) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        tmp.rename(out)
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def read(path: Path) -> Any:
    """The file's gguf-py reader; InvalidRequest in one line where it is no GGUF."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # not a GGUF (its magic number), or one cut short
        raise InvalidRequest(f"{path.name} is not a readable GGUF file ({first_line(e)})", "model") from e


def header(reader: Any, name: str) -> tuple[dict, dict[str, list[float]]]:
    """A GGUF's metadata (its architecture's keys without "{arch}.", and "arch"; no
    tokenizer) and its RoPE factors (1-D F32 tensors); InvalidRequest in one line where it
    is of an architecture the server cannot take from a GGUF."""
    from gguf import GGMLQuantizationType

    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    meta = {k.removeprefix(f"{arch}."): f.contents() for k, f in reader.fields.items()
            if not k.startswith("tokenizer.")}
    if arch not in GGUF_ARCHS:
        raise InvalidRequest(f"{name}: GGUF architecture {arch!r} cannot be converted and served; GGUF files "
                             f"of {', '.join(GGUF_ARCHS)} can (serve its HF folder instead)", "model")
    factors = {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_")
               and t.tensor_type == GGMLQuantizationType.F32 and len(t.shape) == 1}
    return {**meta, "arch": arch}, factors


@contextlib.contextmanager
def _parsed_once(path: Path, reader: Any) -> Iterator[None]:
    """transformers parses the file again for the config and again for the tokenizer,
    seconds each for a vocabulary of 49,152 tokens: it gets the reader parsed here."""
    import gguf

    made, mine = gguf.GGUFReader, path.resolve()

    def reuse(p, *args, **kw):
        return reader if not args and not kw and Path(p).resolve() == mine else made(p, *args, **kw)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = made


def _unread(meta: dict, factors: dict[str, list[float]], cfg: dict) -> dict:
    """Config fields the GGUF holds, as llama.cpp's convert_hf_to_gguf.py writes them, that
    transformers' reader leaves out (`cfg`: what it read)."""
    arch, heads, hidden = meta["arch"], meta["attention.head_count"], meta["embedding_length"]
    out = {field: meta[key] for key, field in UNREAD.get(arch, {}).items() if key in meta}
    if arch == "llama" and meta.get("expert_count"):  # Mixtral's: feed_forward_length is an expert's
        out.update(model_type="mixtral", num_local_experts=meta["expert_count"],
                   num_experts_per_tok=meta["expert_used_count"])
    rope = dict(cfg["rope_parameters"])
    scaled = {}  # the RoPE scaling llama.cpp writes as metadata, or as each pair's divisor (Llama 3's)
    if meta.get("rope.scaling.type") in ("linear", "yarn"):
        scaled = dict(rope_type=meta["rope.scaling.type"], factor=meta["rope.scaling.factor"])
        if scaled["rope_type"] == "yarn":
            scaled["original_max_position_embeddings"] = meta["rope.scaling.original_context_length"]
    if "rope_freqs.weight" in factors:
        scaled = _llama3(factors["rope_freqs.weight"], rope["rope_theta"],
                         meta.get("rope.dimension_count") or hidden // heads)
    if scaled and "full_attention" in rope:  # Gemma 3's: its global layers' (4B and up)
        rope["full_attention"] = dict(rope["full_attention"], **scaled)
    else:
        rope.update(scaled)
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's rule, the file holding none: 1/sqrt(head_dim), but the 27B models'
        # (46 and 62 layers) 1/sqrt(hidden / heads)
        big = meta["block_count"] == (46 if arch == "gemma2" else 62)
        out["query_pre_attn_scalar"] = hidden // heads if big else meta.get("attention.key_length", 256)
    if arch == "phi3":
        out["sliding_window"] = out.get("sliding_window") or None  # 0: none
        rope["partial_rotary_factor"] = meta["rope.dimension_count"] / (hidden // heads)
        if "rope_factors_long.weight" in factors:  # LongRoPE (Phi-3.5, Phi-4-mini)
            rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                        short_factor=factors["rope_factors_short.weight"],
                        original_max_position_embeddings=meta["rope.scaling.original_context_length"])
            if "rope.scaling.attn_factor" in meta:
                rope["attention_factor"] = meta["rope.scaling.attn_factor"]
    return dict(out, rope_parameters=rope) if rope != cfg["rope_parameters"] else out


def _llama3(divisors: list[float], theta: float, dim: int) -> dict:
    """Llama 3's RoPE parameters from each pair's frequency divisor (llama.cpp's rope_freqs):
    the largest is the factor; those between 1 and it lie on its ramp, 1/d = (1 - s)/factor
    + s, s rising linearly in 1/wavelength from 0 at orig/low to 1 at orig/high. Only those
    two ratios matter: orig is the first (Llama 3's 8192, its low_freq_factor 1)."""
    factor = max(divisors)
    ramp = [(theta ** (-2 * i / dim) / (2 * math.pi), (1 / d - 1 / factor) / (1 - 1 / factor))
            for i, d in enumerate(divisors) if 1 < d < factor]
    if len(ramp) < 2:
        raise InvalidRequest(f"cannot recover Llama 3's RoPE from {len(ramp)} pairs on its ramp", "model")
    (x0, s0), (x1, s1) = ramp[0], ramp[-1]
    slope = (s1 - s0) / (x1 - x0)
    low, high = x0 - s0 / slope, x0 + (1 - s0) / slope  # 1/wavelength where s is 0, and 1
    orig = round(1 / low)
    return dict(rope_type="llama3", factor=factor, original_max_position_embeddings=orig,
                low_freq_factor=orig * low, high_freq_factor=orig * high)
