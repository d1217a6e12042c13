"""A GGUF's tensors as an HF checkpoint's weights, streamed: renamed from llama.cpp's names
to HF's, with what llama.cpp's convert_hf_to_gguf.py did to them undone (Llama's q and k
rows permuted for its RoPE, Gemma's norms stored as 1 + w, a mixture's experts stacked),
and dequantized to float32 (gguf-py's `dequantize`, as transformers' reader does) a few
rows at a time straight into model.safetensors, whose header the file's shapes give
before any weight is read. A conversion holds CHUNK bytes of weights, whatever the
model's size; transformers' reader held the whole model, in float32 (28 GB for a 7B)."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokendance.backend.api import InvalidRequest

CHUNK = 64 << 20  # bytes of float32 weights dequantized at once
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# a block's tensors, llama.cpp's name -> HF's within model.layers.N (".weight", ".bias" kept)
BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",  # Phi-3's, fused
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture's router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# where an architecture names them otherwise: Gemma's four norms a block, Phi-3's fused gate
# and up, a "llama" with experts' router (Mixtral's)
OTHER = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "llama": {"ffn_gate_inp": "block_sparse_moe.gate"},
}
OTHER["gemma3"] = OTHER["gemma2"]
# a mixture's stacked experts: each expert's HF name within model.layers.N (Mixtral's own, as
# its checkpoints hold them, which transformers reads; the Qwen mixtures')
EXPERTS = {
    "llama": {"ffn_gate_exps": "block_sparse_moe.experts.{}.w1", "ffn_up_exps": "block_sparse_moe.experts.{}.w3",
              "ffn_down_exps": "block_sparse_moe.experts.{}.w2"},
    "qwen": {"ffn_gate_exps": "mlp.experts.{}.gate_proj", "ffn_up_exps": "mlp.experts.{}.up_proj",
             "ffn_down_exps": "mlp.experts.{}.down_proj"},
}
IN_CONFIG = ("rope_freqs", "rope_factors_long", "rope_factors_short")  # RoPE's (convert.py `header`)
IN_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)")


@dataclass(slots=True)
class Piece:
    """An HF weight: rows of a GGUF tensor (an expert's of stacked ones), in `order` where
    llama.cpp reordered them, less 1 where it stored 1 + w."""

    name: str
    shape: tuple[int, ...]
    tensor: Any  # gguf-py's ReaderTensor
    expert: int | None = None
    order: np.ndarray | None = None
    less_one: bool = False

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape))


def write(reader: Any, arch: str, cfg: dict, dest: Path, chunk: int = CHUNK) -> None:
    """The GGUF `reader` reads, of architecture `arch` and HF config `cfg`, as `dest`/model.safetensors."""
    pieces = plan(reader, arch, cfg)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for p in pieces:
        header[p.name] = {"dtype": "F32", "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the weights start 8-byte aligned, as safetensors writes them
    with open(dest / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for p in pieces:
            for rows in _rows(p, chunk):
                f.write(rows.data)
        if f.tell() != 8 + len(text) + offset:  # the header would misplace every weight after
            raise RuntimeError(f"wrote {f.tell()} bytes of model.safetensors, its header gives "
                               f"{8 + len(text) + offset}")


def plan(reader: Any, arch: str, cfg: dict) -> list[Piece]:
    """Each HF weight the file holds, from its tensors' names and shapes alone."""
    out = []
    for t in reader.tensors:
        stem, _, kind = t.name.rpartition(".")
        if stem in IN_CONFIG:
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dim first
        if stem in TOP:
            out.append(_undone(Piece(f"{TOP[stem]}.{kind}", shape, t), arch, cfg))
            continue
        m = IN_BLOCK.fullmatch(stem)
        part = m and m[2]
        experts = EXPERTS["llama" if arch == "llama" else "qwen"]
        if part in experts:
            out += [_undone(Piece(f"model.layers.{m[1]}.{experts[part].format(e)}.{kind}", shape[1:], t, e),
                            arch, cfg) for e in range(shape[0])]
            continue
        hf = part and (OTHER.get(arch, {}).get(part) or BLOCK.get(part))
        if not hf:
            raise InvalidRequest(f"GGUF tensor {t.name} has no place in an HF {arch} model", "model")
        out.append(_undone(Piece(f"model.layers.{m[1]}.{hf}.{kind}", shape, t), arch, cfg))
    return out


def _undone(p: Piece, arch: str, cfg: dict) -> Piece:
    """`p` as the HF checkpoint holds it, before convert_hf_to_gguf.py changed it."""
    if arch == "llama" and (".q_proj." in p.name or ".k_proj." in p.name):
        heads = cfg["num_attention_heads"] if ".q_proj." in p.name else cfg["num_key_value_heads"]
        # llama.cpp interleaves each head's rotary pairs; HF holds the halves apart
        rows = p.shape[0]
        p.order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    elif arch in ("gemma2", "gemma3") and p.name.endswith("norm.weight"):
        p.less_one = True
    elif p.name.endswith("shared_expert_gate.weight"):
        p.shape = (1, *p.shape)  # llama.cpp squeezes its one row
    return p


def _rows(p: Piece, chunk: int):
    """`p`'s float32 values, in row order, a chunk of rows at a time."""
    from gguf.quants import dequantize

    data = p.tensor.data if p.expert is None else p.tensor.data[p.expert]
    data = data.reshape(-1, 1) if data.ndim == 1 else data  # a vector's values as rows of one
    count = data.shape[0]
    step = max(1, chunk // max(1, p.nbytes // count))
    for r in range(0, count, step):
        sel = data[r:r + step] if p.order is None else data[p.order[r:r + step]]
        w = np.ascontiguousarray(dequantize(sel, p.tensor.tensor_type), dtype=np.float32)
        yield w - 1 if p.less_one else w
