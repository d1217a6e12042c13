"""Agents' memories through LangChain: `embeddings()` embeds with the proxy's model, the
same vectors as /v1/embeddings gives, and a vector store finds a stored memory by them."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_openai")

import openai  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from tokendance.adapters.langgraph import embeddings  # noqa: E402
from tokendance.backend.service import EngineBackend  # noqa: E402
from tokendance.examples.local import threaded  # noqa: E402

MEMORIES = ["Ada proposed a truce in round 2.", "Bo keeps the bridge toll.", "Cy distrusts the river guild."]


@pytest.fixture(scope="module")
def engine_url(tiny_llama):
    be = EngineBackend.load(str(tiny_llama), dtype="float32", mode="collective")
    with threaded(be) as url:
        yield url


def test_langchain_embeds_with_the_proxys_model(engine_url):
    emb = embeddings(url=engine_url)
    docs = emb.embed_documents(MEMORIES)
    direct = openai.OpenAI(base_url=engine_url, api_key="tokendance").embeddings.create(
        model=emb.model, input=MEMORIES, encoding_format="float")
    for got, want in zip(docs, direct.data):
        assert max(abs(a - b) for a, b in zip(got, want.embedding)) < 1e-5
    assert emb.embed_query(MEMORIES[1]) == pytest.approx(docs[1], abs=1e-5)


def test_a_vector_store_finds_a_memory_by_its_text(engine_url):
    store = InMemoryVectorStore.from_texts(MEMORIES, embeddings(url=engine_url))
    for text in MEMORIES:
        (hit,) = store.similarity_search(text, k=1)
        assert hit.page_content == text
