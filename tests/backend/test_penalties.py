"""Logit bias and presence / frequency / repetition penalties (backend/penalties.py),
against a plain-torch reference of vLLM's math, on random logits and in greedy generation."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.detok import Detok
from tokendance.backend.engine import Engine
from tokendance.backend.penalties import Penalized
from tokendance.backend.sampler import choose
from tokendance.backend.sequence import Sequence

PROMPT = list(range(100, 140))


def reference(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """One row, token by token: bias, then repetition, frequency and presence penalties."""
    x = logits.clone()
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, n in Counter(out).items():
        x[t] -= p.frequency_penalty * n
        x[t] -= p.presence_penalty
    return x


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 24), temperature=0, ignore_eos=True, **kw)


MIXED = [
    greedy(frequency_penalty=0.7),
    greedy(),
    greedy(presence_penalty=-1.5, repetition_penalty=1.3),
    greedy(repetition_penalty=0.6, logit_bias={3: 2.5, 17: -4.0}),
    SamplingParams(max_tokens=24, temperature=0.8, seed=1),
    greedy(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=1.9, logit_bias={5: 100.0}),
]


def test_the_sampler_applies_the_reference_math_per_row():
    vocab = 64
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), vocab, generator=g) * 3
    seqs = []
    for i, p in enumerate(MIXED):
        prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
        out = torch.randint(0, vocab, (20,), generator=g).tolist()
        seqs.append(Sequence(f"s{i}", prompt, p, Detok(None), out=out))
    raw = logits.clone()
    got = Penalized.of(logits, seqs).apply(logits)
    assert torch.equal(logits, raw)  # the raw logits stay for logprobs
    for i, (s, p) in enumerate(zip(seqs, MIXED)):
        want = reference(raw[i], s.prompt, s.out, p) if p.penalized else raw[i]
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)
    chosen = choose(logits, seqs, None)
    greedy_rows = [i for i, p in enumerate(MIXED) if p.greedy]
    assert chosen[greedy_rows].tolist() == got[greedy_rows].argmax(-1).tolist()
    # The chosen ids are counted: a second step penalizes them too.
    for i, s in enumerate(seqs):
        if s.sampling.penalized:
            s.out.append(int(chosen[i]))
    again = Penalized.of(logits, seqs).apply(logits)
    for i, (s, p) in enumerate(zip(seqs, MIXED)):
        if p.penalized:
            torch.testing.assert_close(again[i], reference(raw[i], s.prompt, s.out, p), rtol=0, atol=1e-5)


def test_a_batch_without_penalties_builds_nothing():
    seqs = [Sequence("a", [1, 2], greedy(), Detok(None)), Sequence("b", [3], greedy(frequency_penalty=0.0),
                                                                    Detok(None))]
    assert Penalized.of(torch.zeros(2, 8), seqs) is None
    choose(torch.zeros(2, 8), seqs, None)
    assert all(s.seen is None for s in seqs)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)


def run(engine, p: SamplingParams, prompt=PROMPT) -> list[int]:
    return engine.generate([prompt], p)[0][0]


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
def test_a_large_penalty_never_repeats_a_generated_token(engine, name):
    prompt = PROMPT[::2]
    plain = run(engine, greedy(max_tokens=40), prompt)
    assert len(set(plain)) < len(plain)  # the tiny model repeats itself without one
    out = run(engine, greedy(max_tokens=40, **{name: 2.0}), prompt)
    assert len(set(out)) == len(out) == 40


def test_logit_bias_forces_and_forbids_a_token(engine):
    plain = run(engine, greedy())
    token = next(t for t in range(1000, 2000) if t not in plain)
    assert run(engine, greedy(logit_bias={token: 100.0})) == [token] * 24
    banned = run(engine, greedy(logit_bias={plain[0]: -100.0}))
    assert plain[0] not in banned and banned != plain


def hf_reference(folder, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with HF's forward and the reference math, one step at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference(logits, prompt, out, p).argmax()))
    return out


@pytest.mark.parametrize("p", [greedy(repetition_penalty=1.8), greedy(repetition_penalty=0.5),
                               greedy(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                                      logit_bias={PROMPT[0]: 0.1})],
                         ids=["above-1", "below-1", "all"])
def test_greedy_generation_matches_the_reference(engine, p):
    prompt = [7, 8, 9]
    out = run(engine, p, prompt)
    assert out != run(engine, greedy(), prompt)
    assert out == hf_reference(engine.folder, prompt, p)


@pytest.mark.parametrize("overlap", [False, True], ids=["stepwise", "lookahead"])
def test_a_mixed_batch_gives_each_what_it_gets_alone(tiny_llama, engine, overlap):
    """With lookahead, a step's tokens feed the next before the host reads them: the
    penalties still see every one (the counts live on the device)."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, overlap=overlap)
    prompts = [[7, 8, 9], [7, 8, 9], [42] * 30, PROMPT, PROMPT, PROMPT[::2]]
    alone = [run(engine, p, q) for p, q in zip(MIXED, prompts)]
    assert [t for t, _, _ in eng.generate(prompts, MIXED)] == alone
    for out, p, prompt in zip(alone, MIXED, prompts):  # each penalty here changes its answer
        if p.greedy:
            assert (out != run(engine, greedy(), prompt)) == p.penalized


def test_logprobs_are_the_raw_ones(engine):
    """vLLM's default (raw_logprobs): bias and penalties change the choice, not the logprobs."""
    def first(p: SamplingParams):
        engine.add("lp", PROMPT, p)
        (_, delta), = engine.step()
        engine.abort("lp")
        return delta.token_ids[0], delta.logprobs[0]

    kw = dict(max_tokens=2, temperature=0, logprobs=True, top_logprobs=3)
    tok, lp = first(SamplingParams(**kw))
    forced = next(t for t in range(1000, 2000) if t != tok)
    tok2, lp2 = first(SamplingParams(**kw, logit_bias={forced: 100.0}, repetition_penalty=1.5))
    assert tok2 == forced
    assert [(t.token, t.logprob) for t in lp2.top] == [(t.token, t.logprob) for t in lp.top]
    assert lp2.logprob < -5  # the forced token's own, unbiased (biased, it would be near 0)


@pytest.mark.parametrize("kw,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={49152: 1.0}), "logit_bias"),
])
def test_out_of_range_values_name_their_field(engine, kw, param):
    with pytest.raises(InvalidRequest) as err:
        engine.check(PROMPT, SamplingParams(**kw))
    assert err.value.param == param
    engine.check(PROMPT, SamplingParams(logit_bias={49151: -100.0}, presence_penalty=-2.0,
                                        frequency_penalty=2.0, repetition_penalty=0.01))
