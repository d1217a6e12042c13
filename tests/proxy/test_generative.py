"""vLLM's /generative_scoring through the real engine on a tiny random model: each item's
score is its first label's next-token probability after the query and the item, as HF
computes it."""

from __future__ import annotations

import httpx
import pytest
import torch

from .conftest import Threaded

LABELS = [300, 17, 911]


def post(live, **body) -> httpx.Response:
    return httpx.post(live.url + "/generative_scoring", json={"model": live.backend.info.name, **body}, timeout=60)


def expected(hf, prompts: list[list[int]], softmax: bool) -> list[float]:
    out = []
    for ids in prompts:
        with torch.no_grad():
            lp = hf(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)[LABELS]
        out.append(float(lp.softmax(-1)[0] if softmax else lp[0].exp()))
    return out


@pytest.mark.parametrize("item_first", [False, True])
@pytest.mark.parametrize("softmax", [True, False])
def test_scores_are_the_first_labels_probability(engine_live, hf, tok, item_first, softmax):
    query, items = "Is the river wide? Answer:", [" yes it is", " no", " the sea"]
    got = post(engine_live, query=query, items=items, label_token_ids=LABELS, apply_softmax=softmax,
               item_first=item_first)
    assert got.status_code == 200, got.text
    out = got.json()
    q = tok.encode(query)  # with the tokenizer's special tokens; items without
    prompts = [(tok.encode(x, add_special_tokens=False) + q) if item_first else
               (q + tok.encode(x, add_special_tokens=False)) for x in items]
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and {d["object"] for d in out["data"]} == {"score"}
    assert [d["score"] for d in out["data"]] == pytest.approx(expected(hf, prompts, softmax), rel=1e-3, abs=1e-6)
    assert out["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": 3,
                            "total_tokens": sum(map(len, prompts)) + 3, "prompt_tokens_details": {"cached_tokens": 0}}
    assert out["object"] == "list" and out["id"].startswith("generative-scoring-")
    assert got.headers["X-Request-Id"] == out["id"]


def test_token_ids_are_taken_as_given_and_labels_once_each(engine_live, hf):
    query, items = [5, 6, 7, 8], [[20, 21], [22]]
    out = post(engine_live, query=query, items=items, label_token_ids=LABELS + [300], request_id="judge-1").json()
    assert out["id"] == "generative-scoring-judge-1"
    assert [d["score"] for d in out["data"]] == pytest.approx(expected(hf, [query + x for x in items], True), rel=1e-3)


@pytest.mark.parametrize("body, param, message", [
    (dict(query="a", items=[], label_token_ids=[5]), "items", "between 1 and 2048 items, not 0"),
    (dict(query="a", items=["b", [5]], label_token_ids=[5]), "items", "not both"),
    (dict(query="a", items=["b"], label_token_ids=[]), "label_token_ids", "between 1 and 128"),
    (dict(query="a", items=["b"], label_token_ids=[5, 10**9]), "label_token_ids", "outside the vocabulary"),
    (dict(query=[], items=[[]], label_token_ids=[5]), "items", "both empty"),
    (dict(query="a", items=["b"], label_token_ids=[5], priority=1), "priority", "priority"),
    (dict(query=["a"], items=["b"], label_token_ids=[5]), "query[0]", ""),
])
def test_what_cannot_be_scored_is_a_400(engine_live, body, param, message):
    got = post(engine_live, **body)
    assert got.status_code == 400, got.text
    err = got.json()["error"]
    assert err["param"] == param and message in err["message"]


def test_another_model_is_a_404(engine_live):
    got = httpx.post(engine_live.url + "/generative_scoring", json={"model": "gpt-x", "query": "a", "items": ["b"],
                                                                   "label_token_ids": [5]})
    assert got.status_code == 404



@pytest.fixture(scope="module")
def cached(tiny_llama):
    """The engine in `collective`, whose plain prompts share exact prefixes as `prefix` does."""
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="collective"))
    yield t
    t.close()


def test_a_query_asked_again_is_read_from_the_prefix_cache(cached, hf, tok):
    """Plain prompts, exact: a later call's prompts find the query's full blocks cached
    (usage.prompt_tokens_details), and score alike."""
    query = "You judge a debate about rivers. Read the answer below and say whether it is right. " * 2 + "Answer:"
    items = [" yes it is", " no"]
    first = post(cached, query=query, items=items, label_token_ids=LABELS).json()
    again = post(cached, query=query, items=items, label_token_ids=LABELS).json()
    q = tok.encode(query)
    assert len(q) >= 32 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * 16 * (len(q) // 16)
    assert [d["score"] for d in again["data"]] == pytest.approx([d["score"] for d in first["data"]], rel=1e-4)
    prompts = [q + tok.encode(x, add_special_tokens=False) for x in items]
    assert [d["score"] for d in again["data"]] == pytest.approx(expected(hf, prompts, True), rel=1e-3)
