"""A GGUF's weights, streamed into model.safetensors (backend/gguf_tensors.py): quantized
ones dequantized as transformers' GGUF reader dequantizes them, renamed and restored for
each architecture (tests/backend/test_gguf.py serves them against the original models), a
chunk of rows at a time, and a tensor no HF model has a place for a one-line error."""

from __future__ import annotations

import json
import tracemalloc
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tokendance.backend import gguf_tensors, loader
from tokendance.backend.api import InvalidRequest

from .gguf_files import write_gguf
from .test_gguf import KINDS, VOCAB

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("arch,quant", [("llama", Q.Q8_0), ("qwen2_moe", Q.Q4_1), ("gemma2", Q.Q4_0),
                                        ("qwen3", Q.BF16), ("phi3", Q.F16), ("qwen3_moe", Q.Q5_1)])
def test_quantized_weights_are_what_transformers_reads(make_model, gguf_cache, tmp_path, arch, quant):
    """Llama's q and k rows put back, a mixture's experts split, Gemma's norms less 1, Phi-3's
    fused ones as they are, 16-bit floats widened: the folder's weights equal those of
    transformers' model read from the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_gguf(make_model(arch, vocab_size=VOCAB, **KINDS[arch]), tmp_path / f"{arch}.gguf", quant)
    assert any(t.tensor_type == quant for t in gguf.GGUFReader(path).tensors)
    folder = loader.resolve(str(path))
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    cfg = AutoConfig.from_pretrained(folder)  # with what transformers' reader leaves out (the experts' widths)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=cfg,
                                                  dtype=torch.float32).state_dict()
    assert ours.keys() == theirs.keys()
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name


def test_a_conversion_holds_a_chunk_of_weights_not_the_model(make_model, gguf_cache, tmp_path):
    """Written a chunk of rows at a time (numpy's buffers, which tracemalloc counts): less
    at once than half the largest weight (the embeddings, 512 KiB), the model 40 chunks;
    the file is one safetensors reads, holding what the conversion holds."""
    path = write_gguf(make_model("llama", vocab_size=VOCAB, **KINDS["llama"]), tmp_path / "l.gguf", Q.Q8_0)
    whole = loader.resolve(str(path))
    reader, cfg = gguf.GGUFReader(path), json.loads((whole / "config.json").read_text())
    pieces = gguf_tensors.plan(reader, "llama", cfg)
    size, largest = sum(p.nbytes for p in pieces), max(p.nbytes for p in pieces)
    (tmp_path / "out").mkdir()
    tracemalloc.start()
    try:
        gguf_tensors.write(reader, "llama", cfg, tmp_path / "out", chunk=size // 40)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < largest // 2, (peak, largest)
    want, got = load_file(whole / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(got[k], w) for k, w in want.items())


def test_a_tensor_no_hf_model_has_a_place_for_is_one_line(tmp_path):
    stray = SimpleNamespace(name="blk.0.ffn_mystery.weight", tensor_type=Q.F32, data=np.zeros(4, np.float32),
                            shape=np.array([4]))
    with pytest.raises(InvalidRequest, match="GGUF tensor blk.0.ffn_mystery.weight has no place in an HF "
                                             "llama model"):
        gguf_tensors.write(SimpleNamespace(tensors=[stray]), "llama", {}, tmp_path)
    assert not list(tmp_path.iterdir())
