"""GGUF files of every architecture served from one (`--model x.gguf`, backend/loader.py
`resolve`): converted once into a folder whose model is the original's, field for field
where transformers' GGUF reader leaves one out (Qwen3's head_dim, the Qwen MoEs' expert
widths, Gemma's score scalar and caps, Phi-3's window and LongRoPE, Gemma 3's scaled
global RoPE, Llama 3's and YaRN's RoPE), so that the engine serving the GGUF gives the
greedy tokens and logprobs HF gives on the original folder. What no GGUF carries comes
from the original folder's config.json (vLLM's --hf-config-path). What cannot be converted
is a one-line error."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, replace

import gguf
import pytest
import torch

from tokendance.backend import convert, loader
from tokendance.backend.api import InvalidRequest
from tokendance.backend.config import ModelConfig
from tokendance.backend.engine import Engine
from tokendance.backend.rope_scaling import rotary
from tokendance.backend.service import EngineBackend

from .gguf_files import write_gguf
from .test_gemma2 import EAGER, hf_logprobs, scoring
from .test_greedy_vs_hf import hf_greedy, prompts_for, same_tokens

# The GGUFs' tokenizer is SmolLM2's first VOCAB tokens: a conversion reads the file four
# times, and reading 49152 tokens and their merges takes seconds each time here.
VOCAB = 2048
HALF = [1.0, 1.5, 2.5, 4.0]
# Each model with the fields its GGUF carries set off their defaults; head_dim not hidden /
# heads where the real models' is not.
KINDS = {
    # Llama 3's RoPE, which llama.cpp writes as each pair's frequency divisor (rope_freqs)
    "llama": dict(head_dim=32, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                    low_freq_factor=1.0, high_freq_factor=8.0,
                                                    original_max_position_embeddings=512)),
    # YaRN, as Qwen2.5's long context
    "qwen2": dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                       original_max_position_embeddings=1024)),
    "qwen3": dict(head_dim=32),
    # llama.cpp's Mistral is a Llama: no sliding window (Mistral 7B v0.2 on have none)
    "mistral": dict(head_dim=32, sliding_window=None),
    # Phi-4-mini's kind: half of each head turned, LongRoPE; and a window, as Phi-3-mini's
    "phi3": dict(pad_token_id=0, sliding_window=24, max_position_embeddings=65536,
                 original_max_position_embeddings=2048,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=HALF,
                                      long_factor=[3 * f for f in HALF], partial_rotary_factor=0.5)),
    # llama.cpp's Mixtral is a Llama with experts
    "mixtral": dict(head_dim=32, num_local_experts=4, num_experts_per_tok=2),
    # llama.cpp's routers: Qwen2-MoE's weights as they come, Qwen3-MoE's renormalised
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=40, norm_topk_prob=False),
    "qwen3_moe": dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True),
    # query_pre_attn_scalar = head_dim, as the 2B's and 9B's (llama.cpp's rule)
    "gemma2": dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                   attn_logit_softcapping=1.0, final_logit_softcapping=5.0),
    # six layers: the sixth global, its RoPE scaled (Gemma 3 4B's kind)
    "gemma3": dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=24,
                   rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                    "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
}


@pytest.fixture(scope="module")
def files(make_model, gguf_cache, tmp_path_factory, smollm2):
    """files(arch) -> (the tiny model's folder, its GGUF), made once (skipped where the
    embedded GGUF, whose tokenizer they take, is not installed)."""
    root, made = tmp_path_factory.mktemp("gguf"), {}

    def get(arch: str):
        if arch not in made:
            folder = make_model(arch, vocab_size=VOCAB, **KINDS[arch])
            made[arch] = folder, write_gguf(folder, root / f"{arch}.gguf")
        return made[arch]

    return get


def same_model(got: ModelConfig, want: ModelConfig) -> None:
    """Field for field; RoPE as the kernels take it (LongRoPE's long factors too); the
    norms' epsilon to the float32 the file holds."""
    skip = ("arch", "rope", "rms_norm_eps")
    assert {k: v for k, v in asdict(got).items() if k not in skip} == {
        k: v for k, v in asdict(want).items() if k not in skip}
    assert got.arch == ("llama" if want.arch == "mistral" else want.arch)
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)
    for long in (False, True):
        for a, b in zip(rotary(replace(got, long_rope=long)), rotary(replace(want, long_rope=long))):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", list(KINDS))
def test_a_gguf_serves_the_model_it_was_made_from(files, arch):
    folder, path = files(arch)
    served = loader.resolve(str(path))
    want, got = ModelConfig.load(folder), ModelConfig.load(served)
    same_model(got, want)
    ours = loader.load(served, got, torch.float32, "cpu").state_dict()
    for name, w in loader.load(folder, want, torch.float32, "cpu").state_dict().items():
        torch.testing.assert_close(ours[name], w, rtol=0, atol=1e-7)  # Gemma's norms: (1 + w) - 1
    # LongRoPE's short factors, as HF's within original_max_position_embeddings
    eng = Engine(model=str(path), dtype="float32", kv_tokens=2048, max_batched_tokens=64, max_model_len=2048)
    assert eng.folder == served
    prompts = prompts_for(VOCAB, (5, 70), seed=3)  # past the windows of 24
    toks, lps = scoring(eng, prompts, 8)
    attn = EAGER if arch == "gemma2" else None  # HF caps Gemma 2's scores only there
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()
    for t, lp in zip(toks, lps):
        assert lp == pytest.approx(hf_logprobs(hf, t), abs=1e-4)
    for p, t, want_toks in zip(prompts, toks, hf_greedy(folder, prompts, 8, attn)):
        same_tokens(t[len(p):], want_toks)


def test_a_second_resolve_converts_nothing_and_a_changed_file_anew(files, monkeypatch):
    _, path = files("qwen2")
    first = loader.resolve(str(path))

    def converting(gguf):  # a conversion reads the file first
        raise AssertionError(f"converted {gguf.name} again")

    monkeypatch.setattr(convert, "read", converting)
    assert loader.resolve(str(path)) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    with pytest.raises(AssertionError, match="converted qwen2.gguf again"):
        loader.resolve(str(path))


def test_a_conversion_parses_the_file_once(files, gguf_cache, monkeypatch):
    """transformers' config and tokenizer readers get the reader parsed for the header
    (a vocabulary of 49,152 tokens takes seconds to parse each time)."""
    import gguf as gguf_py

    _, path = files("qwen3")
    parsed, made = [], gguf_py.GGUFReader

    def counted(p, *args, **kw):
        parsed.append(p)
        return made(p, *args, **kw)

    monkeypatch.setattr(gguf_py, "GGUFReader", counted)
    for f in gguf_cache.glob("qwen3-*"):
        shutil.rmtree(f)
    loader.resolve(str(path))
    assert parsed == [path]
    assert gguf_py.GGUFReader is counted


def _metadata_only(path, arch: str):
    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", [
    "olmo2",  # served from an HF folder; transformers reads no OLMo 2 GGUF
    "gpt2",  # transformers reads it; not served
])
def test_an_architecture_it_cannot_convert_is_a_one_line_error(gguf_cache, tmp_path, arch):
    path = _metadata_only(tmp_path / "m.gguf", arch)
    with pytest.raises(InvalidRequest, match=re.escape(f"m.gguf: GGUF architecture '{arch}' cannot be")) as e:
        loader.resolve(str(path))
    assert "\n" not in str(e.value) and "qwen3moe" in str(e.value)


@pytest.mark.parametrize("content", [b"", b"not a gguf file at all\n" * 40, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64],
                         ids=["empty", "text", "cut short"])
def test_a_file_that_is_no_gguf_is_a_one_line_error(gguf_cache, tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(InvalidRequest, match="bad.gguf is not a readable GGUF file") as e:
        Engine(model=str(path), dtype="float32", kv_tokens=1024)
    assert "\n" not in str(e.value)
    assert not list(gguf_cache.glob("bad*"))  # no half folder left behind


def test_hf_config_path_gives_what_no_gguf_carries(make_model, gguf_cache, tmp_path):
    """Mistral v0.1's sliding window, which llama.cpp does not write: served from the GGUF
    alone, the model attends past it; with the original folder's config.json it is the
    original model, and that folder's generation config gives the ends and the defaults."""
    folder = make_model("mistral", vocab_size=VOCAB, head_dim=32, sliding_window=24)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "eos_token_id": 7}))
    path = write_gguf(folder, tmp_path / "m.gguf")
    kw = dict(dtype="float32", kv_tokens=1024, max_batched_tokens=64)
    alone, given = Engine(model=str(path), **kw), Engine(model=str(path), hf_config_path=str(folder), **kw)
    assert given.folder == alone.folder == loader.resolve(str(path))  # the same weights
    assert (alone.mcfg.windows, given.mcfg.windows) == ((), (24, 24))
    prompts = prompts_for(VOCAB, (60, 70), seed=5)  # past the window
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    toks, lps = scoring(given, prompts, 6)
    for t, lp in zip(toks, lps):
        assert lp == pytest.approx(hf_logprobs(hf, t), abs=1e-4)
    _, far = scoring(alone, prompts, 6)  # what the GGUF alone serves: not the original
    assert max(abs(a - b) for x, y in zip(far, lps) for a, b in zip(x, y)) > 1e-2
    assert 7 in given.eos and 7 not in alone.eos
    assert EngineBackend(given).info.sampling == {"temperature": 0.6}
    assert EngineBackend(alone).info.sampling == {}


def test_a_config_that_is_not_the_models_is_one_line(files, tmp_path):
    _, path = files("qwen3")
    other = files("llama")[0]  # no q and k norms
    with pytest.raises(InvalidRequest, match=re.escape(f"k_norm.weight in model.safetensors: not in the model "
                                                       f"{other}/config.json describes")) as e:
        Engine(model=str(path), hf_config_path=str(other), dtype="float32", kv_tokens=1024)
    assert e.value.param == "hf_config_path" and "\n" not in str(e.value)
    with pytest.raises(InvalidRequest, match=f"--hf-config-path {tmp_path / 'none'}: no such file or folder"):
        Engine(model=str(path), hf_config_path=str(tmp_path / "none"), dtype="float32", kv_tokens=1024)
    with pytest.raises(InvalidRequest, match=f"--hf-config-path {tmp_path}: no config.json in it"):
        Engine(model=str(path), hf_config_path=str(tmp_path), dtype="float32", kv_tokens=1024)
