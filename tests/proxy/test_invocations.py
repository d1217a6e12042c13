"""SageMaker's `/invocations`, as vLLM serves it: the body's fields choose the API, and the
answer is that API's; a body none fits is a 400 naming what it takes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import Threaded


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Threaded]:
    from tokendance.backend.service import EngineBackend

    t = Threaded(EngineBackend.load(str(tiny_llama), dtype="float32", mode="full"))
    yield t
    t.close()


def post(server: Threaded, path: str, body: object) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.parametrize("path, body, answer", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0},
     lambda j: j["choices"][0]["message"]["content"]),
    ("/v1/completions", {"prompt": "The round opens", "max_tokens": 5, "temperature": 0},
     lambda j: j["choices"][0]["text"]),
    ("/v1/embeddings", {"input": ["a round", "of agents"]}, lambda j: [d["embedding"] for d in j["data"]]),
])
def test_the_body_chooses_the_api(server, path, body, answer):
    body = {"model": server.backend.info.name, **body}
    direct, invoked = post(server, path, body), post(server, "/invocations", body)
    assert direct.status_code == invoked.status_code == 200, invoked.text
    assert answer(invoked.json()) == answer(direct.json()) and invoked.json()["object"] == direct.json()["object"]


@pytest.mark.parametrize("body", [{"model": "m"}, ["messages"], {"nothing": 1}])
def test_a_body_no_api_takes_is_a_400(server, body):
    r = post(server, "/invocations", body)
    assert r.status_code == 400 and "/invocations takes a chat (messages)" in r.json()["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(server):
    r = httpx.post(server.url + "/invocations", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
