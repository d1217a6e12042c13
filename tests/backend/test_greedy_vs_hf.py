"""Greedy tokens of our engine equal HF transformers generate on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.prompt import render_chat


def hf_greedy(folder, prompts: list[list[int]], n: int, attn: str | None = None) -> list[list[int]]:
    """HF's greedy tokens (`attn`: its attention implementation, else its default)."""
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()
    gc = GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0)
    out = []
    with torch.no_grad():
        for p in prompts:
            out.append(hf.generate(torch.tensor([p]), generation_config=gc)[0, len(p):].tolist())
    return out


def same_tokens(ours: list[int], hf: list[int], eos: int = 2) -> None:
    """HF stops at eos even when told not to; we ran on (ignore_eos): compare its span."""
    assert hf, "HF generated nothing"
    assert len(hf) == len(ours) or hf[-1] == eos
    assert ours[: len(hf)] == hf


def prompts_for(vocab: int, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_matches_hf(tiny_models, arch):
    folder = tiny_models[arch]
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=8192, max_batched_tokens=512)
    prompts = prompts_for(eng.mcfg.vocab_size, (3, 17, 64, 200, 1100), seed=7)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ours = eng.generate(prompts, greedy)
    ref = hf_greedy(folder, prompts, 24)
    for (toks, _, reason), want in zip(ours, ref):
        assert reason == "length"
        same_tokens(toks, want)
    # prefix mode, cold and then hitting its own blocks, gives the same tokens
    variants = prompts + [p[: len(p) // 2] + [5, 6, 7] for p in prompts]
    full = eng.generate(variants, greedy)
    assert eng.generate(variants, greedy, mode="prefix") == full
    assert eng.generate(variants, greedy, mode="prefix") == full


def test_mistral_matches_hf(make_model):
    folder = make_model("mistral", sliding_window=None)
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=2048)
    prompts = prompts_for(eng.mcfg.vocab_size, (9, 130), seed=3)
    ours = eng.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for (toks, _, _), want in zip(ours, hf_greedy(folder, prompts, 16)):
        same_tokens(toks, want)


def test_smollm2_matches_hf(smollm2):
    eng = Engine(model=None, dtype="float32", kv_tokens=4096)
    chats = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence why the sky is blue.",
        "Name three prime numbers.",
        "Summarise the following notes. " + " ".join(f"Note {i}: the meeting moved to room {i % 7}." for i in range(90)),
    ]
    prompts = [eng.encode(render_chat(eng.tokenizer, [{"role": "user", "content": c}])) for c in chats]
    assert max(map(len, prompts)) >= 1000
    ours = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for (toks, _, _), want in zip(ours, hf_greedy(smollm2, prompts, 12)):
        same_tokens(toks, want)


def test_a_head_dim_of_no_power_of_two_matches_hf(make_model):
    """Head dims the Triton kernels do not tile (80, 96 in the wild) run the references, on a
    GPU too: the Mirrors' collective path included."""
    folder = make_model("llama", hidden_size=96, head_dim=24)
    eng = Engine(model=str(folder), dtype="float32", kv_tokens=2048)
    prompts = prompts_for(eng.mcfg.vocab_size, (11, 150), seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ours = eng.generate(prompts, greedy)
    for (toks, _, _), want in zip(ours, hf_greedy(folder, prompts, 12)):
        same_tokens(toks, want)
    # two agents that read the first answer at their own offsets, every token recomputed: exact
    seg = ours[0][0]
    group = [[7, 8] + seg + [9], [4, 5, 6, 10] + seg + [12, 13]]
    shared = [[(2, 2 + len(seg))], [(4, 4 + len(seg))]]
    want = eng.generate(group, greedy)
    reuse = Engine(model=str(folder), dtype="float32", kv_tokens=2048, recompute_ratio=1.0, min_shared_tokens=0)
    assert reuse.generate(group, greedy, mode="collective", shared=shared) == want
    assert reuse.segments.held  # the answer's KV was computed once, as a base
