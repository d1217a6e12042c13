"""vLLM's `/score` and `/rerank` on the real engine over a tiny random model: each pair's
score is the cosine of HF's last hidden states of its two texts; vLLM's list names and
pairings, ranking and `top_n`, token limits; a 400 for what cannot be scored."""

from __future__ import annotations

import httpx
import pytest
import torch

from tokendance.examples.echo import EchoBackend

from .conftest import Threaded

QUERY = "Where does the river run?"
DOCS = ["The river runs to the sea.", "Ada bakes bread at dawn.", "A bridge crosses the river.", "x"]


def vector(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]


def cosine(hf, tok, a: str, b: str) -> float:
    return torch.nn.functional.cosine_similarity(vector(hf, tok(a)["input_ids"]), vector(hf, tok(b)["input_ids"]),
                                                 dim=0).item()


def post(live, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(live.url + path, json=body, timeout=60, **kw)


def test_one_query_against_every_document(engine_live, engine_model, hf, tok):
    r = post(engine_live, "/score", {"model": engine_model, "queries": QUERY, "documents": DOCS},
             headers={"X-Request-Id": "mem-1"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["id"] == "score-mem-1" == r.headers["X-Request-Id"] and got["object"] == "list"
    assert got["model"] == engine_model and [d["index"] for d in got["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in got["data"])
    want = [cosine(hf, tok, QUERY, d) for d in DOCS]
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-5)
    used = sum(len(tok(t)["input_ids"]) for t in [QUERY, *DOCS])  # each text once
    assert got["usage"] == {"prompt_tokens": used, "total_tokens": used, "completion_tokens": 0}


@pytest.mark.parametrize("names", [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                   ("text_1", "text_2")])
def test_pairs_by_any_of_vllms_names(engine_live, engine_model, hf, tok, names):
    one, two = ["Ada", "The river"], ["Bo", "runs to the sea"]
    r = post(engine_live, "/v1/score", {"model": engine_model, names[0]: one, names[1]: two})
    assert r.status_code == 200, r.text
    want = [cosine(hf, tok, a, b) for a, b in zip(one, two)]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_answers_the_documents_best_first(engine_live, engine_model, hf, tok, path):
    want = [cosine(hf, tok, QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    r = post(engine_live, path, {"model": engine_model, "query": QUERY, "documents": DOCS, "top_n": 2,
                                 "request_id": "r7"}).json()
    assert r["id"] == "score-r7" and r["model"] == engine_model
    assert [x["index"] for x in r["results"]] == order[:2]
    assert [x["document"] for x in r["results"]] == [{"text": DOCS[i], "multi_modal": None} for i in order[:2]]
    assert [x["relevance_score"] for x in r["results"]] == pytest.approx([want[i] for i in order[:2]], abs=1e-5)
    used = sum(len(tok(t)["input_ids"]) for t in [QUERY, *DOCS])
    assert r["usage"] == {"prompt_tokens": used, "total_tokens": used}
    every = post(engine_live, path, {"query": QUERY, "documents": DOCS}).json()["results"]
    assert [x["index"] for x in every] == order  # top_n 0: all of them


def test_token_limits_cut_texts_to_their_first_tokens(engine_live, engine_model, hf, tok):
    doc = "The river runs to the sea, past the mill and the old stone bridge."
    ids = tok(doc, add_special_tokens=False)["input_ids"]
    head = tok.decode(ids[:5])
    r = post(engine_live, "/score", {"queries": QUERY, "documents": [doc], "max_tokens_per_doc": 5}).json()
    assert r["data"][0]["score"] == pytest.approx(cosine(hf, tok, QUERY, head), abs=1e-5)
    assert r["usage"]["prompt_tokens"] == len(tok(QUERY)["input_ids"]) + len(tok(head)["input_ids"])
    whole = post(engine_live, "/score", {"queries": QUERY, "documents": [doc], "truncate_prompt_tokens": 4,
                                         "truncation_side": "left"}).json()
    tail = vector(hf, tok(doc)["input_ids"][-4:])
    q = vector(hf, tok(QUERY)["input_ids"][-4:])
    assert whole["data"][0]["score"] == pytest.approx(torch.cosine_similarity(q, tail, dim=0).item(), abs=1e-5)


@pytest.mark.parametrize("path,body,param", [
    ("/score", {"queries": QUERY}, "documents"),
    ("/score", {"documents": DOCS}, "queries"),
    ("/score", {"queries": QUERY, "documents": DOCS, "text_1": "a", "text_2": "b"}, "queries"),
    ("/score", {"queries": QUERY, "documents": DOCS, "items": DOCS}, "queries"),
    ("/score", {"queries": ["a", "b"], "documents": ["a", "b", "c"]}, "queries"),
    ("/score", {"queries": [], "documents": DOCS}, "queries"),
    ("/score", {"queries": QUERY, "documents": ["a", ""]}, "documents"),
    ("/score", {"queries": QUERY, "documents": [{"content": [{"type": "image_url"}]}]}, "documents"),
    ("/score", {"queries": QUERY, "documents": DOCS, "max_tokens_per_doc": -1}, "max_tokens_per_doc"),
    ("/score", {"queries": QUERY, "documents": DOCS, "max_tokens_per_query": 10**6}, "max_tokens_per_query"),
    ("/score", {"queries": QUERY, "documents": DOCS, "priority": 2}, "priority"),
    ("/score", {"queries": QUERY, "documents": [" ".join(["word"] * 5000)]}, "documents"),
    ("/rerank", {"query": [QUERY], "documents": DOCS}, "query"),
    ("/rerank", {"documents": DOCS}, "query"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/rerank", {"query": QUERY, "documents": 7}, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
], ids=["no-documents", "no-queries", "two-pairs", "documents-and-items", "two-to-three", "empty", "empty-text",
        "multimodal", "negative-limit", "limit-over-context", "priority", "too-long", "query-list", "no-query",
        "negative-top-n", "not-texts", "top-n-text"])
def test_what_cannot_be_scored_is_a_400_naming_its_field(engine_live, path, body, param):
    r = post(engine_live, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_another_model_is_a_404_and_the_server_goes_on(engine_live, engine_model):
    assert post(engine_live, "/rerank", {"model": "nope", "query": "a", "documents": ["b"]}).status_code == 404
    assert post(engine_live, "/rerank", {"model": engine_model, "query": "a", "documents": ["b"]}).status_code == 200
    text = httpx.get(engine_live.url + "/metrics").text
    assert 'tokendance_requests_total{code="404",endpoint="rerank"}' in text


def test_a_backend_without_a_model_refuses_scores():
    t = Threaded(EchoBackend())
    try:
        r = httpx.post(t.url + "/score", json={"queries": "a", "documents": ["b"]})
        assert r.status_code == 400 and "embeddings" in r.json()["error"]["message"]
    finally:
        t.close()
