"""vLLM's beam search through the proxy (proxy/beams.py) on the real engine and a tiny
random Llama: against a plain beam search over HF transformers' log-probabilities,
against HF's own `num_beams` where no beam can end, with end tokens, its refusals, and a
client that leaves mid-search."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from .conftest import Threaded

PROMPT = [5, 17, 300, 4000, 12, 99, 7]


@pytest.fixture(scope="module")
def served(tiny_llama):
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full"))
    yield t
    t.close()


def reference(hf, prompt: list[int], width: int, steps: int, ends: set[int] = frozenset(),
              penalty: float = 1.0, min_tokens: int = 0) -> list[list[int]]:
    """vLLM's beam search, plainly: every live beam's 2w likeliest next tokens under HF's
    model, the w best continuations live on, an end token's kept aside."""
    def score(b):
        return b[1] / (len(prompt) + len(b[0])) ** penalty

    live, done = [([], 0.0, None)], []
    for _ in range(steps):
        grown = []
        for toks, lp, _ in live:
            with torch.no_grad():
                lps = hf(torch.tensor([prompt + toks])).logits[0, -1].float().log_softmax(-1)
            top = lps.topk(2 * width)
            for v, i in zip(top.values.tolist(), top.indices.tolist()):
                if i not in ends:
                    grown.append((toks + [i], lp + v, None))
                elif len(toks) >= min_tokens:
                    done.append((toks, lp + v, i))
        live = sorted(grown, key=score, reverse=True)[:width]
    best = sorted(done + live, key=score, reverse=True)[:width]
    return [toks + ([end] if end is not None else []) for toks, _, end in best]


def beams(t: Threaded, **body) -> dict:
    r = httpx.post(t.url + "/v1/completions", json={"model": t.backend.info.name, "use_beam_search": True, **body},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_beams_are_a_plain_beam_search_over_the_models_logprobs(served, hf):
    out = beams(served, prompt=PROMPT, n=3, max_tokens=5, return_token_ids=True)
    got = [c["token_ids"] for c in out["choices"]]
    assert got == reference(hf, PROMPT, 3, 5)
    assert len({tuple(g) for g in got}) == 3 and [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["finish_reason"] == "length" for c in out["choices"])
    tok = served.backend.tokenizer
    assert [c["text"] for c in out["choices"]] == [tok.decode(g) for g in got]
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (7, 15)


def test_where_no_beam_can_end_they_are_hfs_num_beams(served, hf):
    """HF ranks all beams' continuations at once, vLLM each beam's 2n best first: with no
    end token in play the two agree."""
    width, steps = 4, 6
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), num_beams=width, num_return_sequences=width, do_sample=False,
                           max_new_tokens=steps, min_new_tokens=steps, length_penalty=1.0)
    want = [row[len(PROMPT):].tolist() for row in want]
    got = beams(served, prompt=PROMPT, n=width, max_tokens=steps, ignore_eos=True, return_token_ids=True)
    assert [c["token_ids"] for c in got["choices"]] == want


def test_end_tokens_finish_beams_and_min_tokens_bars_them(served, hf):
    # the tokens the beams would take at their second step: ending there, they compete
    first = reference(hf, PROMPT, 3, 2)
    ends = {first[0][1], first[1][1]}
    for min_tokens, penalty in ((0, 1.0), (0, 0.0), (2, 1.0)):
        body = dict(prompt=PROMPT, n=3, max_tokens=4, stop_token_ids=sorted(ends), length_penalty=penalty,
                    min_tokens=min_tokens, return_token_ids=True)
        got = beams(served, **body)["choices"]
        want = reference(hf, PROMPT, 3, 4, ends, penalty, min_tokens)
        assert [c["token_ids"] for c in got] == want
        for c in got:
            ended = c["token_ids"][-1] in ends
            assert c["finish_reason"] == ("stop" if ended else "length")
            assert c["stop_reason"] == (c["token_ids"][-1] if ended else None)
        if min_tokens:
            assert all(len(c["token_ids"]) > min_tokens for c in got)
        else:
            assert any(c["finish_reason"] == "stop" for c in got)  # what the case is for


def test_each_beam_offers_twice_n_continuations(served, hf):
    """Where a beam's n likeliest tokens all end it, its next n still go on (and, under a
    length penalty this steep, outscore the ended)."""
    ends = set(sum(reference(hf, PROMPT, 2, 1), []))  # the first step's two likeliest
    got = beams(served, prompt=PROMPT, n=2, max_tokens=3, stop_token_ids=sorted(ends), length_penalty=5.0,
                return_token_ids=True)
    assert [c["token_ids"] for c in got["choices"]] == reference(hf, PROMPT, 2, 3, ends, penalty=5.0)
    assert all(len(c["token_ids"]) == 3 for c in got["choices"])


def test_no_length_penalty_overflows_the_ranking(served, hf):
    """Beams are ranked in logs: under a penalty this steep the longest come first, ended ones last."""
    ends = set(sum(reference(hf, PROMPT, 2, 1), []))
    got = beams(served, prompt=PROMPT, n=3, max_tokens=3, stop_token_ids=sorted(ends), length_penalty=1e308,
                return_token_ids=True)["choices"]
    assert [(len(c["token_ids"]), c["finish_reason"]) for c in got] == [(3, "length")] * 3


def test_chat_streamed_and_several_prompts(served):
    name = served.backend.info.name
    chat = {"model": name, "messages": [{"role": "user", "content": "Say something."}], "n": 2,
            "max_tokens": 4, "use_beam_search": True}
    whole = httpx.post(served.url + "/v1/chat/completions", json=chat, timeout=60).json()
    texts = [c["message"]["content"] for c in whole["choices"]]
    assert len(set(texts)) == 2
    with httpx.stream("POST", served.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60) as r:
        lines = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: {")]
    chunks = [json.loads(x) for x in lines]
    streamed = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                        if c["choices"] and c["choices"][0]["index"] == i) for i in range(2)]
    assert streamed == texts
    two = beams(served, prompt=[PROMPT, PROMPT[:4]], n=2, max_tokens=3, return_token_ids=True)["choices"]
    one = beams(served, prompt=PROMPT[:4], n=2, max_tokens=3, return_token_ids=True)["choices"]
    assert [c["token_ids"] for c in two[2:]] == [c["token_ids"] for c in one]


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 11}, "n"), ({"stop": ["x"]}, "stop"), ({"echo": True, "logprobs": 1}, "echo"),
    ({"logprob_token_ids": [5], "logprobs": 0}, "logprob_token_ids"), ({"prompt_logprobs": 0}, "prompt_logprobs"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tokendance": {"session": "s", "agent": "a"}}, "use_beam_search"),
    ({"length_penalty": "long"}, "length_penalty")])
def test_what_a_beam_search_cannot_take_is_a_400(served, extra, param):
    r = httpx.post(served.url + "/v1/completions", json={"model": served.backend.info.name, "prompt": "Hi",
                                                         "use_beam_search": True, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_logprobs_are_each_chosen_tokens_and_its_best_alternatives(served, hf):
    """With logprobs, each choice's tokens (an end token too) come with HF's log-softmax
    at that place and its k best alternatives, best first; they sum to the beam's
    cumulative logprob, which ranks the choices. k above 2n is asked of every step."""
    ends = set(sum(reference(hf, PROMPT, 3, 2), [])[1::2][:1])  # a second-step token: a beam ends by it
    for n, k in ((3, 2), (2, 5)):  # 5 > 2n: the steps ask for more than the search needs
        out = beams(served, prompt=PROMPT, n=n, max_tokens=4, stop_token_ids=sorted(ends), logprobs=k,
                    return_token_ids=True)
        assert [c["token_ids"] for c in out["choices"]] == reference(hf, PROMPT, n, 4, ends)
        assert any(c["finish_reason"] == "stop" for c in out["choices"])  # an end token's logprob is listed too
        sums = []
        for c in out["choices"]:
            ids, lp = c["token_ids"], c["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
            for j, tok in enumerate(ids):
                with torch.no_grad():
                    want = hf(torch.tensor([PROMPT + ids[:j]])).logits[0, -1].float().log_softmax(-1)
                assert lp["token_logprobs"][j] == pytest.approx(float(want[tok]), abs=1e-4)
                top = lp["top_logprobs"][j]
                assert list(top.values()) == pytest.approx(want.topk(k).values.tolist(), abs=1e-4)
            sums.append(sum(lp["token_logprobs"]))
        lengths = [len(PROMPT) + len(c["token_ids"]) - (c["finish_reason"] == "stop") for c in out["choices"]]
        scores = [x / n for x, n in zip(sums, lengths)]
        assert scores == sorted(scores, reverse=True)
    chat = httpx.post(served.url + "/v1/chat/completions", json={
        "model": served.backend.info.name, "messages": [{"role": "user", "content": "Say something."}], "n": 2,
        "max_tokens": 3, "use_beam_search": True, "logprobs": True, "top_logprobs": 3}, timeout=60).json()
    for c in chat["choices"]:
        items = c["logprobs"]["content"]
        assert len(items) == 3 and all(len(x["top_logprobs"]) == 3 for x in items)
        assert "".join(x["token"] for x in items) == c["message"]["content"]
    plain = httpx.post(served.url + "/v1/chat/completions", json={
        "model": served.backend.info.name, "messages": [{"role": "user", "content": "Say something."}], "n": 2,
        "max_tokens": 3, "use_beam_search": True}, timeout=60).json()
    assert [c["message"]["content"] for c in plain["choices"]] == [c["message"]["content"] for c in chat["choices"]]
    assert all(c.get("logprobs") is None for c in plain["choices"])


def test_what_asks_for_nothing_is_taken(served):
    beams(served, prompt="Hi", n=2, max_tokens=2, stop=[], presence_penalty=0, repetition_penalty=1,
          logit_bias={}, response_format={"type": "text"}, temperature=0.7, seed=3, logprob_token_ids=[],
          echo=True)


def test_a_client_that_leaves_ends_its_search(served):
    """The search stops with its client: no step of it is left in the engine."""
    eng = served.backend.engine
    with pytest.raises(httpx.TimeoutException):
        httpx.post(served.url + "/v1/completions", json={"model": served.backend.info.name, "prompt": PROMPT,
                                                         "use_beam_search": True, "n": 4, "max_tokens": 4000,
                                                         "ignore_eos": True}, timeout=1.0)
    quiet, deadline = time.monotonic(), time.monotonic() + 10
    while time.monotonic() - quiet < 1.0 and time.monotonic() < deadline:  # a second with no step in it
        if eng.seqs:
            quiet = time.monotonic()
        time.sleep(0.01)
    assert time.monotonic() - quiet >= 1.0
    assert beams(served, prompt=PROMPT, n=2, max_tokens=2)["choices"]  # and the server goes on
