"""vLLM's allowed_token_ids and bad_words (backend/banned.py): what a request may not
sample, against a step-by-step HF reference, with and without lookahead."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.banned import banned, sequences
from tokendance.backend.engine import Engine

PROMPT = list(range(100, 140))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 24), temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)


def run(engine: Engine, p: SamplingParams) -> list[int]:
    return engine.generate([PROMPT], p)[0][0]


def hf_greedy(folder, p: SamplingParams, bad: list[list[int]]) -> list[int]:
    """HF's forward, one token at a time, the reference bans applied to its logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            x = hf(torch.tensor([PROMPT + out])).logits[0, -1]
            if p.allowed_token_ids is not None:
                keep = x[p.allowed_token_ids].clone()
                x = torch.full_like(x, float("-inf"))
                x[p.allowed_token_ids] = keep
            for s in bad:  # the whole sequence would end here
                if len(s) == 1 or out[-(len(s) - 1):] == s[:-1]:
                    x[s[-1]] = float("-inf")
            out.append(int(x.argmax()))
    return out


def test_a_word_is_banned_alone_and_after_a_space(engine):
    tok = engine.tokenizer
    seqs = sequences(tok, ["  bridge"])
    assert tok.encode("bridge", add_special_tokens=False) in seqs
    assert tok.encode(" bridge", add_special_tokens=False) in seqs and len(seqs) == 2
    assert banned([[5], [1, 2, 3], [2, 9]], [7, 1, 2]) == [3, 5, 9]
    assert banned([[1, 2, 3]], [2]) == [] and banned([[4, 1, 2, 3]], [1, 2]) == []


def test_allowed_token_ids_keep_to_their_set_as_the_reference(engine):
    plain = run(engine, greedy())
    allowed = [t for t in range(1000, 1040)] + [plain[3]]
    p = greedy(allowed_token_ids=allowed)
    out = run(engine, p)
    assert set(out) <= set(allowed) and out != plain
    assert out == hf_greedy(engine.folder, p, [])


@pytest.mark.parametrize("overlap", [False, True], ids=["stepwise", "lookahead"])
def test_bad_words_never_complete_as_the_reference(tiny_llama, engine, overlap):
    plain = run(engine, greedy())
    words = [engine.tokenizer.decode(plain[4:6]), engine.tokenizer.decode(plain[10:11])]
    p = greedy(bad_words=words)
    bad = sequences(engine.tokenizer, words)
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, overlap=overlap)
    (out, _, _), (again, _, _) = eng.generate([PROMPT, PROMPT], [p, greedy()])  # the other keeps lookahead
    assert again == plain and out != plain
    assert not any(out[i:i + len(s)] == s for s in bad for i in range(len(out)))
    assert out == hf_greedy(engine.folder, p, bad)


@pytest.mark.parametrize("kw,param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[5, 49152]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"), (dict(bad_words=["a", ""]), "bad_words"),
])
def test_bad_values_name_their_field(engine, kw, param):
    with pytest.raises(InvalidRequest) as err:
        engine.check(PROMPT, SamplingParams(**kw))
    assert err.value.param == param
    engine.check(PROMPT, SamplingParams(allowed_token_ids=[0, 49151], bad_words=["the"]))
