"""`/v1/embeddings` through the openai SDK, on the real engine over a tiny random model:
each input's vector is HF's last hidden state of its tokens, in float or base64 (the
SDK's default), for texts and token ids; vLLM's extra fields; and a 400 for what cannot
be served."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest
import torch

from tokendance.examples.echo import EchoBackend

from .conftest import Threaded


def expected(hf, ids: list[int], normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
    return torch.nn.functional.normalize(h, dim=-1) if normalize else h


TEXTS = ["The river runs to the sea.", "Ada proposes a truce", "x"]


@pytest.mark.parametrize("fmt", ["float", None], ids=["float", "base64-by-default"])
def test_each_input_is_embedded_in_its_order(engine_client, engine_model, hf, tok, fmt):
    kw = {"encoding_format": fmt} if fmt else {}
    r = engine_client.embeddings.create(model=engine_model, input=TEXTS, **kw)
    assert r.object == "list" and r.model == engine_model and [d.index for d in r.data] == [0, 1, 2]
    ids = [tok(t)["input_ids"] for t in TEXTS]  # vLLM's add_special_tokens: true
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids):
        assert d.object == "embedding"
        assert torch.allclose(torch.tensor(d.embedding), expected(hf, i), atol=1e-5)


def test_token_ids_and_vllms_fields(engine_client, engine_model, hf, tok):
    ids = tok("Ada proposes a truce to Grace", add_special_tokens=False)["input_ids"]
    one = engine_client.embeddings.create(model=engine_model, input=ids, encoding_format="float")
    two = engine_client.embeddings.create(model=engine_model, input=[ids, ids[:3]], encoding_format="float")
    assert len(one.data) == 1 and len(two.data) == 2 and one.usage.prompt_tokens == len(ids)
    assert torch.allclose(torch.tensor(one.data[0].embedding), expected(hf, ids), atol=1e-5)
    assert torch.allclose(torch.tensor(two.data[1].embedding), expected(hf, ids[:3]), atol=1e-5)
    raw = engine_client.embeddings.create(model=engine_model, input=ids, encoding_format="float",
                                          extra_body={"use_activation": False, "truncate_prompt_tokens": 4})
    assert raw.usage.prompt_tokens == 4  # a pooling model keeps the first tokens, as vLLM's does
    assert torch.allclose(torch.tensor(raw.data[0].embedding), expected(hf, ids[:4], False), atol=1e-4)
    tail = engine_client.embeddings.create(model=engine_model, input=ids, encoding_format="float", extra_body={
        "truncate_prompt_tokens": 4, "truncation_side": "left"})
    assert torch.allclose(torch.tensor(tail.data[0].embedding), expected(hf, ids[-4:]), atol=1e-5)
    plain = engine_client.embeddings.create(model=engine_model, input="Ada", encoding_format="float",
                                            extra_body={"add_special_tokens": False})
    assert plain.usage.prompt_tokens == len(tok("Ada", add_special_tokens=False)["input_ids"])


def test_vllms_chat_form_request_id_and_use_activation(engine_live, engine_client, engine_model, hf, tok):
    chat = [{"role": "user", "content": "Where is Ada?"}, {"role": "assistant", "content": "At the bridge."}]
    http = httpx.post(engine_live.url + "/v1/embeddings", headers={"X-Request-Id": "mem-7"},
                      json={"model": engine_model, "messages": chat, "use_activation": False})
    assert http.status_code == 200 and http.headers["X-Request-Id"] == "embd-mem-7"
    r = http.json()
    assert r["id"] == "embd-mem-7"
    ids = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
    assert r["usage"]["prompt_tokens"] == len(ids)  # no generation prompt, no BOS: vLLM's defaults
    assert torch.allclose(torch.tensor(r["data"][0]["embedding"]), expected(hf, ids, False), atol=1e-4)
    named = engine_client.embeddings.create(model=engine_model, input="a", extra_body={"request_id": "n1"})
    assert named.id == "embd-n1"


def test_several_chats_in_messages_or_input(engine_live, engine_model):
    a = [{"role": "user", "content": "Where is Ada?"}]
    b = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And Bo?"}]
    got = {}
    for name, body in {"a": {"messages": a}, "b": {"input": b}, "both": {"messages": [a, b]},
                       "both-input": {"input": [a, b]}}.items():
        r = httpx.post(engine_live.url + "/v1/embeddings", json={"model": engine_model, **body})
        assert r.status_code == 200, r.text
        got[name] = [d["embedding"] for d in r.json()["data"]]
    assert torch.allclose(torch.tensor(got["both"]), torch.tensor(got["a"] + got["b"]), atol=1e-5)
    assert torch.allclose(torch.tensor(got["both-input"]), torch.tensor(got["both"]), atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("endianness", ["native", "big"])
def test_vllms_encodings(engine_live, engine_model, dtype, endianness):
    """base64 and bytes carry each vector as torch converts it, in the byte order asked."""
    body = {"model": engine_model, "input": ["Ada", "Bo and Cy"]}
    floats = httpx.post(engine_live.url + "/v1/embeddings", json=body).json()
    kinds = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    want = [torch.tensor(d["embedding"]).to(kinds[dtype]).view(torch.uint8).numpy() for d in floats["data"]]
    if endianness == "big" and dtype in ("float32", "float16", "bfloat16"):
        want = [w.reshape(-1, torch.finfo(kinds[dtype]).bits // 8)[:, ::-1] for w in want]
    want = [w.tobytes() for w in want]
    enc = {"embed_dtype": dtype, "endianness": endianness}
    b64 = httpx.post(engine_live.url + "/v1/embeddings", json={**body, **enc, "encoding_format": "base64"}).json()
    assert [base64.b64decode(d["embedding"]) for d in b64["data"]] == want
    raw = httpx.post(engine_live.url + "/v1/embeddings", json={**body, **enc, "encoding_format": "bytes"})
    assert raw.headers["content-type"] == "application/octet-stream" and raw.content == b"".join(want)
    meta = json.loads(raw.headers["metadata"])
    assert meta["id"] == raw.headers["X-Request-Id"] and meta["usage"] == floats["usage"]
    assert [raw.content[d["start"]:d["end"]] for d in meta["data"]] == want
    assert {(d["embed_dtype"], d["endianness"], tuple(d["shape"])) for d in meta["data"]} == {
        (dtype, endianness, (len(floats["data"][0]["embedding"]),))}
    only = httpx.post(engine_live.url + "/v1/embeddings", json={**body, **enc, "encoding_format": "bytes_only"})
    assert only.content == b"".join(want) and "metadata" not in only.headers


@pytest.mark.parametrize("kw,param", [
    ({"input": "a", "extra_body": {"messages": [{"role": "user", "content": "a"}]}}, "input"),
    ({"input": None, "extra_body": {"messages": []}}, "messages"),
    ({"input": None, "extra_body": {"messages": [{"role": "user", "content": "word " * 10000}]}}, "messages"),
    ({"input": "a", "extra_body": {"cache_salt": ""}}, "cache_salt"),
    ({"input": "a", "extra_body": {"request_id": "has space"}}, "request_id"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": ["a", 7]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "dimensions": 8}, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "extra_body": {"priority": 1}}, "priority"),
    ({"input": "a", "extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": "a", "extra_body": {"normalize": True}}, "normalize"),
    ({"input": "a", "extra_body": {"embed_dtype": "int8"}}, "embed_dtype"),
    ({"input": "a", "extra_body": {"endianness": "middle"}}, "endianness"),
    ({"input": "a", "extra_body": {"truncation_side": "middle"}}, "truncation_side"),
    ({"input": "a", "extra_body": {"padding": "max_length"}}, "padding"),
    ({"input": "a", "extra_body": {"mm_processor_kwargs": {"size": 2}}}, "mm_processor_kwargs"),
    ({"input": None, "extra_body": {"messages": ["a"]}}, "messages"),
    ({"input": None, "extra_body": {"messages": [{"role": "user", "content": 3}]}}, "messages"),
], ids=["both-forms", "no-messages", "long-messages", "salt", "request-id", "empty", "empty-string", "an-empty-string",
        "an-empty-list", "mixed", "outside-vocab", "too-many", "dimensions", "format", "priority", "truncate",
        "object", "normalize", "dtype", "endianness", "side", "padding", "multimodal", "not-a-chat", "bad-message"])
def test_what_cannot_be_embedded_is_a_400_naming_its_field(engine_client, engine_model, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        engine_client.embeddings.create(model=engine_model, **kw)
    assert e.value.body["param"] == param


def test_the_whole_context_is_embedded_not_a_token_more(engine_live, engine_client, engine_model):
    """No token is generated, so a prompt may fill the context (a chat's must leave one)."""
    n = engine_live.backend.info.max_model_len
    full = engine_client.embeddings.create(model=engine_model, input=[5] * n)
    cut = engine_client.embeddings.create(model=engine_model, input=[5] * (2 * n),
                                          extra_body={"truncate_prompt_tokens": -1})
    assert full.usage.prompt_tokens == cut.usage.prompt_tokens == n
    assert full.data[0].embedding == pytest.approx(cut.data[0].embedding, abs=1e-5)
    with pytest.raises(openai.BadRequestError) as e:
        engine_client.embeddings.create(model=engine_model, input=[5] * (n + 1))
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "input", e.value.body


def test_the_server_goes_on_after_a_bad_call_and_counts_the_calls(engine_live, engine_client, engine_model):
    with pytest.raises(openai.NotFoundError):
        engine_client.embeddings.create(model="no-such-model", input="a")
    with pytest.raises(openai.BadRequestError):
        engine_client.embeddings.create(model=engine_model, input=["fine", 3])
    assert engine_client.embeddings.create(model=engine_model, input="fine").data
    text = httpx.get(engine_live.url + "/metrics").text
    assert 'tokendance_requests_total{code="400",endpoint="embeddings"}' in text
    assert 'tokendance_requests_total{code="200",endpoint="embeddings"}' in text


def test_a_backend_without_a_model_refuses_embeddings():
    t = Threaded(EchoBackend())
    try:
        with pytest.raises(openai.BadRequestError) as e:
            t.client().embeddings.create(model=t.backend.info.name, input="a")
        assert "embeddings" in e.value.body["message"]
    finally:
        t.close()


def test_vllms_pooling_gives_the_embeddings(engine_live, engine_model):
    body = {"model": engine_model, "input": ["Ada", "Bo and Cy"]}
    vectors = httpx.post(engine_live.url + "/v1/embeddings", json=body).json()
    pooled = httpx.post(engine_live.url + "/pooling", json={**body, "task": "embed", "request_id": "p1"}).json()
    assert pooled["id"] == "pool-p1" and pooled["object"] == "list" and pooled["usage"] == vectors["usage"]
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    assert torch.allclose(torch.tensor([d["data"] for d in pooled["data"]]),
                          torch.tensor([d["embedding"] for d in vectors["data"]]), atol=1e-6)
    r = httpx.post(engine_live.url + "/pooling", json={**body, "task": "token_embed"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "task"
