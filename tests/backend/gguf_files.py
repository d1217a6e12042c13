"""A tiny HF folder (tests/conftest.py `make_tiny`) as a GGUF file, written as llama.cpp's
convert_hf_to_gguf.py writes one: its architecture's metadata keys, tensors under their
GGUF names with llama.cpp's transformations (q and k rows permuted for Llama and Mistral,
Gemma's norms as 1 + weight, each layer's experts stacked), all of them F32 so that a
reader's round trip is exact, and the embedded SmolLM2 GGUF's tokenizer, whose
vocabulary the tiny models use."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

from tokendance.backend.loader import default_gguf

# model_type -> llama.cpp's architecture (Mistral's and Mixtral's are Llama's there)
ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
        "phi3": "phi3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "gemma3": "gemma3"}
EXPERT = re.compile(r"(.+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def write_gguf(folder: Path, dest: Path, quant: gguf.GGMLQuantizationType | None = None) -> Path:
    """`folder`'s model as the GGUF file `dest`; with `quant`, its matrices (rows of whole
    blocks) quantized so, as llama.cpp's quantized files hold them."""
    cfg = json.loads((folder / "config.json").read_text())
    kind = cfg["model_type"].removesuffix("_text")  # gemma3_text
    arch = ARCH[kind]
    w = gguf.GGUFWriter(str(dest), arch)
    w.add_name(f"Tiny {kind}")  # transformers reads a "llama" as Mistral's only where the name is "mistral"
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _metadata(w, cfg, kind)
    for key, (value, vtype, sub) in _tokenizer(cfg["vocab_size"]).items():
        w.add_key_value(key, value, vtype, sub)
    for name, t in _tensors(folder, cfg, kind, arch):
        t = t.squeeze().contiguous().numpy()  # convert_hf_to_gguf squeezes every tensor
        if quant is not None and t.ndim >= 2 and t.shape[-1] % gguf.GGML_QUANT_SIZES[quant][0] == 0:
            w.add_tensor(name, gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def _rope(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    return rope.get("full_attention", rope)  # Gemma 3's by layer type: llama.cpp writes the global layers'


def _metadata(w: gguf.GGUFWriter, c: dict, kind: str) -> None:
    heads, hidden, rope = c["num_attention_heads"], c["hidden_size"], _rope(c)
    head_dim = c.get("head_dim") or hidden // heads
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if kind != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if kind in ("llama", "mistral", "mixtral"):
        w.add_vocab_size(c["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if "num_experts_per_tok" in c:
        w.add_expert_count(c.get("num_experts") or c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
    if "moe_intermediate_size" in c:  # Mixtral's experts are feed_forward_length wide
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if kind == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    if kind in ("phi3", "gemma2", "gemma3"):
        w.add_sliding_window(c.get("sliding_window") or 0)  # Phi-3's 0: none
    if kind == "gemma2":
        w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if rope.get("rope_type") in ("linear", "yarn"):  # Gemma 3's: its global layers' (4B and up)
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
        if rope["rope_type"] == "yarn":
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if kind == "phi3":
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        orig = c["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(orig)
        if rope.get("rope_type") == "longrope":  # llama.cpp's own attention factor, HF's default
            scale = c["max_position_embeddings"] / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)


@functools.cache
def _tokenizer(vocab: int) -> dict[str, tuple]:
    """The embedded GGUF's tokenizer.* fields: key -> (value, type, array item type), its
    vocabulary cut to the first `vocab` tokens where the model has fewer (and the merges to
    those among them): a reader's time goes on these arrays, and a conversion reads the
    file several times."""
    out = {}
    for key, f in gguf.GGUFReader(default_gguf()).fields.items():
        if key.startswith("tokenizer."):
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            out[key] = [f.contents(), f.types[0], f.types[-1] if array else None]
    tokens = out["tokenizer.ggml.tokens"][0][:vocab]
    kept = set(tokens)
    out["tokenizer.ggml.tokens"][0] = tokens
    out["tokenizer.ggml.token_type"][0] = out["tokenizer.ggml.token_type"][0][:vocab]
    out["tokenizer.ggml.merges"][0] = [m for m in out["tokenizer.ggml.merges"][0]
                                       if m.replace(" ", "") in kept and set(m.split(" ")) <= kept]
    return {k: tuple(v) for k, v in out.items()}


def _tensors(folder: Path, c: dict, kind: str, arch: str) -> list[tuple[str, torch.Tensor]]:
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], c["num_hidden_layers"])
    out, experts = [], {}
    for name, t in load_file(folder / "model.safetensors").items():
        if name == "lm_head.weight" and c.get("tie_word_embeddings"):
            continue
        if m := EXPERT.match(name):
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"])
        if kind.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores what Gemma's norms scale by
        out.append((names.get_name(name, try_suffixes=(".weight", ".bias")), t))
    for stem, parts in experts.items():  # (experts, rows, columns): ffn_{gate,up,down}_exps
        out.append((names.get_name(stem) + ".weight", torch.stack([parts[i] for i in sorted(parts)])))
    rope = _rope(c)
    if kind == "phi3" and rope.get("rope_type") == "longrope":
        for which in ("long", "short"):
            tensor = gguf.MODEL_TENSOR[f"ROPE_FACTORS_{which.upper()}"]
            out.append((gguf.TENSOR_NAMES[tensor] + ".weight", torch.tensor(rope[f"{which}_factor"])))
    if rope.get("rope_type") == "llama3":
        dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        out.append(("rope_freqs.weight", _llama3(rope, dim)))
    return out


def _llama3(rope: dict, dim: int) -> torch.Tensor:
    """Llama 3's RoPE as llama.cpp's LlamaModel writes it: each pair's frequency divisor."""
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    wavelen, orig, factor = 2 * math.pi / inv, rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (orig / wavelen - low) / (high - low)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < orig / high, 1.0, torch.where(wavelen > orig / low, factor, ramp))


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a head's rows for its RoPE (pairs interleaved), which
    transformers' GGUF reader reverses."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
