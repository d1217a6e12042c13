"""Embeddings and scores through a vLLM server (`serve --vllm URL`), against the fake one
of tests/proxy/fake_vllm.py: the proxy sends it token ids and computes what vLLM leaves
to it (a rerank's cosines, a generative score's softmax over the labels)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tokendance.proxy.scores import cosine

from .fake_vllm import client, vllm_vector


async def test_embeddings_go_to_vllm_as_token_ids_and_its_refusal_is_a_400(proxy, vllm):
    r = await client(proxy).embeddings.create(model="fake-vllm", input=[[5, 6, 7], [9]], encoding_format="float",
                                               extra_body={"use_activation": False})
    assert [d.embedding for d in r.data] == [[18.0, 3.0, 5.0], [9.0, 1.0, 9.0]]
    assert r.usage.prompt_tokens == 4
    assert sorted(b["input"] for b in vllm.bodies[-2:]) == [[5, 6, 7], [9]]
    assert not any(b["use_activation"] for b in vllm.bodies[-2:])
    with pytest.raises(openai.BadRequestError) as e:
        await client(proxy).embeddings.create(model="fake-vllm", input=[0, 1])
    assert "does not support Embeddings" in e.value.body["message"]


async def test_a_rerank_scores_the_vllm_servers_embeddings(proxy, vllm):
    """Each text is one embedding call; the cosines are the proxy's."""
    tok = proxy.proxy.backend.tokenizer
    docs = ["b c", "d"]
    async with httpx.AsyncClient() as http:
        got = (await http.post(proxy.url + "/rerank", json={"query": "a", "documents": docs})).json()
    vec = {t: vllm_vector(tok(t)["input_ids"]) for t in ["a", *docs]}
    want = [cosine(vec["a"], vec[d]) for d in docs]
    assert [x["relevance_score"] for x in got["results"]] == pytest.approx(sorted(want, reverse=True))
    assert [x["index"] for x in got["results"]] == sorted(range(2), key=lambda i: -want[i])


async def test_a_generative_score_reads_the_vllm_servers_label_logprobs(proxy, vllm):
    """Each item is one completion of one token with logprob_token_ids; the softmax over
    the labels is the proxy's."""
    async with httpx.AsyncClient() as http:
        got = (await http.post(proxy.url + "/generative_scoring", json={
            "query": "Good?", "items": [" a", " b"], "label_token_ids": [9, 3]})).json()
    sent = [b for b in vllm.bodies if b.get("logprob_token_ids")]
    assert len(sent) == 2 and all(b["max_tokens"] == 1 and b["logprob_token_ids"] == [9, 3] for b in sent)
    a, b = math.exp(-1.009), math.exp(-1.003)  # as the fake server gives them
    assert [d["score"] for d in got["data"]] == pytest.approx([a / (a + b)] * 2)
