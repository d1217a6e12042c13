"""Sampling: seeds, top-k/top-p, stop strings and token ids, logprobs."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.sampler import _filter


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=4096)


PROMPT = list(range(100, 140))


def run(engine, sampling, prompt=PROMPT):
    return engine.generate([prompt], sampling)[0]


def test_seed_reproducible_and_independent_of_batch(engine):
    s = SamplingParams(max_tokens=16, temperature=1.0, seed=42, ignore_eos=True)
    a = run(engine, s)[0]
    others = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    batch = engine.generate([PROMPT, [5, 6, 7], [9] * 30, PROMPT], [s] + others)
    assert batch[0][0] == a
    b = run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=43, ignore_eos=True))[0]
    assert a != b


def test_the_engines_seed_draws_unseeded_requests(tiny_llama):
    """vLLM's --seed: two engines of one seed sample alike where a request names none."""
    s = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    runs = [run(Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024, seed=seed), s)[0]
            for seed in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


def test_top_k_one_is_greedy(engine):
    greedy = run(engine, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert run(engine, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=1, ignore_eos=True))[0] == greedy


def test_a_tiny_temperature_is_greedy_and_spares_its_batch(engine):
    greedy = run(engine, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    tiny = SamplingParams(max_tokens=12, temperature=1e-40, ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    (a, _, _), (b, _, reason) = engine.generate([PROMPT, PROMPT], [tiny, other])
    assert a == greedy and len(b) == 12 and reason == "length"


def test_a_top_k_past_the_vocabulary_keeps_every_token(engine):
    s = SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    plain = run(engine, s)[0]
    assert run(engine, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True,
                                      top_k=2**64 - 1))[0] == plain


def test_filter_masks_per_row():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0]])
    out = _filter(logits, torch.tensor([2, 0]), torch.tensor([1.0, 0.5]), torch.tensor([0.0, 0.0]), True)
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    p = logits[1].softmax(-1)
    keep = int(((p.cumsum(-1) - p) <= 0.5).sum())
    assert torch.isfinite(out[1, :keep]).all() and torch.isinf(out[1, keep:]).all()


def test_max_tokens_and_stop_token_ids(engine):
    toks, _, reason = run(engine, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(toks) == 7 and reason == "length"
    stop_at = toks[3]
    toks2, _, reason2 = run(engine, SamplingParams(max_tokens=7, temperature=0, stop_token_ids=[stop_at], ignore_eos=True))
    assert reason2 == "stop" and toks2 == toks[: toks.index(stop_at) + 1]


def test_stop_string_cuts_text(engine):
    toks, text, _ = run(engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert len(text) > 12
    stop = text[6:10]
    _, cut, reason = run(engine, SamplingParams(max_tokens=30, temperature=0, stop=[stop], ignore_eos=True))
    assert reason == "stop" and cut == text[: text.index(stop)]


def test_logprobs_match_model_distribution(engine):
    eng = engine
    eng.add("lp", PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=3))
    (rid, delta), = eng.step()
    lp = delta.logprobs[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(eng.folder, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].log_softmax(-1)
    top = ref.topk(3)
    assert delta.token_ids == [int(top.indices[0])]
    assert lp.logprob == pytest.approx(float(top.values[0]), abs=1e-4)
    assert [t.logprob for t in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp.token == eng.tokenizer.decode([delta.token_ids[0]])


def test_label_logprobs_are_the_asked_tokens_in_every_row(engine, hf):
    """vLLM's logprob_token_ids: each step lists exactly the asked tokens, in their order,
    with the model's logprobs; a batch mixes them with top_logprobs rows and plain rows."""
    labels = [7, 300, 2, 999]
    other = list(range(60, 90))
    asked = SamplingParams(max_tokens=3, temperature=0, logprobs=True, top_logprobs=5, logprob_token_ids=labels,
                           ignore_eos=True)
    topped = SamplingParams(max_tokens=3, temperature=0, logprobs=True, top_logprobs=2, ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    for i, (p, s) in enumerate([(PROMPT, asked), (other, topped), (PROMPT[:20], plain), (other, asked)]):
        engine.add(f"lab{i}", p, s)
    got: dict[str, list] = {}
    while engine.has_work():
        for rid, d in engine.step():
            got.setdefault(rid, []).append(d)
    for rid, prompt in (("lab0", PROMPT), ("lab3", other)):
        ids = [t for d in got[rid] for t in d.token_ids]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        lps = [lp for d in got[rid] for lp in d.logprobs]
        assert len(lps) == 3
        for row, lp in zip(ref, lps):
            assert [t.id for t in lp.top] == labels
            assert [t.logprob for t in lp.top] == pytest.approx(row[labels].tolist(), abs=1e-4)
            assert lp.top[1].token == engine.tokenizer.decode([300])
    assert all(len(lp.top) == 2 for d in got["lab1"] for lp in d.logprobs)
    assert all(not d.logprobs for d in got["lab2"])


def test_label_logprobs_must_lie_in_the_vocabulary(engine):
    bad = SamplingParams(max_tokens=1, logprobs=True, logprob_token_ids=[1, engine.mcfg.vocab_size])
    with pytest.raises(InvalidRequest, match="logprob_token_ids names token ids outside the vocabulary"):
        engine.add("bad", PROMPT, bad)
    with pytest.raises(InvalidRequest, match="between 1 and 128"):
        SamplingParams(logprobs=True, logprob_token_ids=list(range(129))).validate()


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 3)
    p = logits[0].softmax(-1)
    out = _filter(logits, torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 1.0]),
                  torch.tensor([0.0, float(p[1] / p[0]) + 1e-3, 1.0]), True)
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1, :1]).all() and torch.isinf(out[1, 1:]).all()
    assert torch.isfinite(out[2, :1]).all() and torch.isinf(out[2, 1:]).all()  # the likeliest stays


def test_top_p_is_over_what_top_k_left_renormalized():
    """vLLM's (and HF's) order: top-p after top-k, over the kept tokens' renormalized mass."""
    logits = torch.tensor([[2.0, 1.9, 1.8, 0.0, 0.0, 0.0]])
    out = _filter(logits, torch.tensor([3]), torch.tensor([0.6]), torch.tensor([0.0]), True)
    # of the top 3 (~1/3 each) two reach 0.6; over all six the first two would hold ~0.55
    assert torch.isfinite(out[0, :2]).all() and torch.isinf(out[0, 2:]).all()


def test_min_p_samples_only_from_what_it_keeps(engine):
    """A min_p of 1 leaves only the likeliest token: sampling at any temperature is greedy."""
    greedy = run(engine, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    hot = SamplingParams(max_tokens=12, temperature=2.0, seed=7, ignore_eos=True)
    assert run(engine, hot)[0] != greedy
    hot.min_p = 1.0
    assert run(engine, hot)[0] == greedy


def test_min_tokens_holds_off_stop_tokens_and_strings(engine):
    toks, text, _ = run(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    stop_at = toks[1]
    early = run(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]))
    assert early[0] == toks[:2] and early[2] == "stop"
    late, _, reason = run(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop_at], min_tokens=6))
    assert len(late) >= 7 and stop_at not in late[:6] and reason in ("stop", "length")
    assert reason == "length" or late[-1] == stop_at
    piece = engine.tokenizer.decode(toks[:2])
    cut = run(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[piece[-2:]]))
    assert cut[2] == "stop" and len(cut[0]) <= 2
    held = run(engine, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[piece[-2:]],
                                      min_tokens=4))
    assert len(held[0]) > 4 and held[1].startswith(piece)  # the stop string in its first tokens is passed


def test_min_tokens_keeps_eos_out_of_its_first_tokens(engine):
    eos = sorted(engine.eos)
    prompt = PROMPT[:5]
    biased = dict(max_tokens=8, temperature=0, logit_bias={eos[0]: 100.0})
    assert run(engine, SamplingParams(**biased), prompt)[0] == [eos[0]]
    toks, _, reason = run(engine, SamplingParams(**biased, min_tokens=3), prompt)
    assert len(toks) == 4 and not set(toks[:3]) & set(eos) and toks[3] == eos[0] and reason == "stop"


def test_a_stop_string_can_stay_in_the_text(engine):
    _, text, _ = run(engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop = text[6:10]
    _, kept, reason = run(engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))
    assert reason == "stop" and kept == text[: text.index(stop) + len(stop)]


def test_special_tokens_can_be_written_out(engine):
    eos = sorted(engine.eos)[0]
    s = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={eos: 100.0})
    _, skipped, _ = run(engine, SamplingParams(**s))
    _, written, _ = run(engine, SamplingParams(**s, skip_special_tokens=False))
    assert skipped == "" and written == engine.tokenizer.decode([eos] * 3)


def test_logits_past_float_range_fail_no_one(engine):
    """A repetition_penalty just above 0 makes seen tokens' logits inf: that row takes its
    argmax and the request beside it in the batch samples as it would alone."""
    good = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    bad = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True, repetition_penalty=1e-320)
    alone = run(engine, good)[0]
    (b, _, reason), (g, _, _) = engine.generate([PROMPT, PROMPT], [bad, good])
    assert len(b) == 8 and reason == "length" and g == alone
    assert b[0] in PROMPT  # a seen token: the only ones the penalty made inf


def test_stop_token_ids_outside_the_vocabulary_end_nothing(engine):
    """They can never be sampled; with min_tokens they mask nothing (a negative id would
    index from the vocabulary's end)."""
    s = dict(max_tokens=6, temperature=0, ignore_eos=True)
    plain = run(engine, SamplingParams(**s))[0]
    vocab = engine.mcfg.vocab_size
    assert run(engine, SamplingParams(**s, stop_token_ids=[-1, vocab, 10**12], min_tokens=3))[0] == plain
    last = SamplingParams(**s, stop_token_ids=[vocab - 1, -1], min_tokens=2, logit_bias={vocab - 1: 100.0})
    toks = run(engine, last)[0]
    assert toks == toks[:2] + [vocab - 1] and vocab - 1 not in toks[:2]


def test_a_draw_follows_its_distribution_and_leaves_greedy_rows():
    from types import SimpleNamespace

    from tokendance.backend.sampler import draw

    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    hot, cold = SamplingParams(temperature=1.0), SamplingParams(temperature=0)
    rows = [SimpleNamespace(sampling=hot, generator=torch.Generator().manual_seed(3)),
            SimpleNamespace(sampling=cold, generator=None)]
    greedy = torch.tensor([3, 2])
    counts = torch.zeros(4)
    for _ in range(4000):
        got = draw(probs, rows, None, greedy)
        assert int(got[1]) == 2
        counts[int(got[0])] += 1
    assert torch.allclose(counts / 4000, probs[0], atol=0.03), counts
