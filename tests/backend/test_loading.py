"""A model loaded from a checkpoint is built without drawing random weights
(backend/start.py): the checkpoint writes every weight, and nothing keeps what the memory
held before. The tests poison that memory."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokendance.backend import loader
from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig
from tokendance.backend.quant import Quant
from tokendance.examples import cli
from tokendance.kernels.fp8_linear import E4M3

E4M3_NAN = 0x7F


def _poisoning(real):
    """`torch.empty` whose tensors hold NaN (e4m3 and integer ones NaN's e4m3 byte), not
    zeros or whatever the allocator had: what a layer built without drawing starts from."""
    def empty(*args, **kw):
        t = real(*args, **kw)
        if t.dtype == E4M3 or not t.dtype.is_floating_point:
            t.view(torch.uint8).fill_(E4M3_NAN) if t.element_size() == 1 else t.fill_(E4M3_NAN)
        else:
            t.fill_(float("nan"))
        return t
    return empty


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoning(torch.empty))


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.view(torch.uint8) if v.dtype == E4M3 else v
            for k, v in [*model.named_parameters(), *model.named_buffers()]}


def assert_same(got: nn.Module, want: nn.Module) -> None:
    g, w = tensors(got), tensors(want)
    assert g.keys() == w.keys()
    for k in w:
        assert torch.equal(g[k], w[k]), k


def load(folder: Path, quant: Quant | None = None) -> nn.Module:
    cfg = ModelConfig.load(folder)
    return loader.load(folder, cfg if quant is None else replace(cfg, quant=quant), torch.float32, "cpu")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "granite", "phi3", "qwen2_moe"])
def test_every_tensor_is_the_checkpoints_or_computed(make_model, arch, monkeypatch):
    """Loaded into NaN-filled memory, the model equals one loaded over drawn weights (the
    way every load went before), tensor for tensor, tied heads too."""
    folder = make_model(arch)
    real = loader.build
    monkeypatch.setattr(loader, "build", lambda *a, start=True, **kw: real(*a, start=True, **kw))
    want = load(folder)
    monkeypatch.setattr(loader, "build", real)
    with monkeypatch.context() as m:
        m.setattr(torch, "empty", _poisoning(torch.empty))
        got = load(folder)
    assert_same(got, want)
    if ModelConfig.load(folder).tie_embeddings:
        assert got.lm_head.weight is got.model.embed_tokens.weight



def test_eight_bit_loads_write_every_row(tiny_llama, tmp_path, poisoned):
    """`--quantization fp8` (rows rounded as read) and a stored FP8 checkpoint hold the same
    bytes and scales, none of them NaN."""
    out = tmp_path / "fp8"
    assert cli.main(["quantize", str(tiny_llama), str(out)]) == 0
    rounded, stored = load(tiny_llama, Quant("fp8", False)), load(out)
    assert_same(stored, rounded)
    eight = [b for b in stored.buffers() if b.dtype == E4M3]  # not by class: tests/kernels reloads it
    assert len(eight) == 2 * 4
    for b in eight:
        assert not torch.isnan(b.float()).any()
    for k, t in tensors(stored).items():
        assert t.dtype == torch.uint8 or not torch.isnan(t).any(), k


def test_a_checkpoint_short_of_a_whole_tensor_names_it(tiny_llama, tmp_path, poisoned):
    dst = tmp_path / "short"
    shutil.copytree(tiny_llama, dst)
    weights = load_file(str(dst / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(dst / "model.safetensors"))
    with pytest.raises(InvalidRequest, match="the checkpoint holds no model.norm.weight, which the model the "
                                             "config describes has"):
        load(dst)


def test_a_random_weight_model_still_starts_random(tiny_llama):
    """`build`'s default draws weights as torch's layers do: shapes served without a
    checkpoint (the benches' `qwen2.5-7b`) are not NaN or zeros."""
    cfg = ModelConfig.load(tiny_llama)
    torch.manual_seed(0)
    model = loader.build(cfg, torch.float32, "cpu")
    w = model.model.layers[0].self_attn.qkv_proj.weight
    assert torch.isfinite(w).all() and w.std() > 0
