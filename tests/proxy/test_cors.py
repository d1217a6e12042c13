"""Cross-origin requests (proxy/cors.py), as vLLM answers them: by default any origin,
method and header; preflights answered without the API key; streamed answers and errors
carry the header too; named origins echoed, others refused."""

from __future__ import annotations

import json

import httpx
import pytest

from tokendance.examples import cli
from tokendance.proxy import serve
from tokendance.proxy.cors import Cors

from .conftest import FakeBackend, Threaded

PAGE = "https://page.example"
CHAT = {"model": "fake-tiny", "messages": [{"role": "user", "content": "a b c"}]}


def preflight(url: str, origin: str = PAGE, method: str = "POST", headers: str = "authorization, content-type"):
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers})


@pytest.fixture(scope="module")
def keyed():
    t = Threaded(FakeBackend(length=8), api_keys=frozenset({"sk-right"}))
    yield t
    t.close()


@pytest.fixture(scope="module")
def named():
    t = Threaded(FakeBackend(length=8), cors=Cors(origins=(PAGE,), methods=("get", "POST"),
                                                   headers=("X-Trace",), credentials=True))
    yield t
    t.close()


def test_by_default_any_page_may_call_even_before_its_key_is_checked(keyed):
    r = preflight(keyed.url)
    assert r.status_code == 200 and r.text == "OK"
    assert r.headers["Access-Control-Allow-Origin"] == "*"
    assert r.headers["Access-Control-Allow-Methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert r.headers["Access-Control-Max-Age"] == "600"
    assert "Access-Control-Allow-Credentials" not in r.headers and "Vary" not in r.headers


def test_answers_errors_and_streams_carry_the_origin_header(keyed):
    auth = {"Origin": PAGE, "Authorization": "Bearer sk-right"}
    r = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers=auth)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
    assert r.json()["choices"][0]["message"]["content"] == "a b c"
    wrong = httpx.post(keyed.url + "/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
    assert wrong.status_code == 401 and wrong.headers["Access-Control-Allow-Origin"] == "*"
    with httpx.stream("POST", keyed.url + "/v1/chat/completions", json=CHAT | {"stream": True}, headers=auth) as s:
        assert s.status_code == 200 and s.headers["Access-Control-Allow-Origin"] == "*"
        assert s.headers["Content-Type"].startswith("text/event-stream")
        assert list(s.iter_lines())[-2] == "data: [DONE]"
    plain = httpx.get(keyed.url + "/health")  # no Origin: no CORS headers
    assert plain.status_code == 200 and "Access-Control-Allow-Origin" not in plain.headers


def test_an_options_request_that_is_no_preflight_is_routed_as_before(keyed):
    r = httpx.options(keyed.url + "/tokenize", headers={"Origin": PAGE})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_named_origins_are_echoed_with_credentials_and_others_refused(named):
    r = preflight(named.url, headers="content-type, x-trace")
    assert r.status_code == 200
    assert r.headers["Access-Control-Allow-Origin"] == PAGE and r.headers["Vary"] == "Origin"
    assert r.headers["Access-Control-Allow-Credentials"] == "true"
    assert r.headers["Access-Control-Allow-Methods"] == "get, POST"
    assert r.headers["Access-Control-Allow-Headers"] == ("accept, accept-language, content-language, "
                                                         "content-type, x-trace")
    ok = httpx.post(named.url + "/v1/chat/completions", json=CHAT, headers={"Origin": PAGE})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == PAGE
    assert ok.headers["Access-Control-Allow-Credentials"] == "true"

    other = preflight(named.url, origin="https://other.example")
    assert other.status_code == 400 and "Access-Control-Allow-Origin" not in other.headers
    err = other.json()["error"]
    assert err["message"].startswith("Disallowed CORS origin, headers: https://other.example asked POST")
    # Not a browser: served, but with no header a browser would let its page read it by.
    served = httpx.post(named.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "https://other.example"})
    assert served.status_code == 200 and "Access-Control-Allow-Origin" not in served.headers


@pytest.mark.parametrize("method,headers,refused", [
    ("DELETE", "content-type", "method"), ("post", "authorization", "headers"), ("PUT", "x-other", "method, headers")])
def test_a_method_or_header_not_named_is_refused(named, method, headers, refused):
    r = preflight(named.url, method=method, headers=headers)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(f"Disallowed CORS {refused}: {PAGE} asked {method}")
    assert r.headers["Access-Control-Allow-Origin"] == PAGE  # the page may read why


def test_the_flags_make_the_policy_and_bad_ones_are_one_line(monkeypatch, capsys):
    parser = cli.Parser(prog="tokendance")
    serve.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args([
        "serve", "--allowed-origins", json.dumps([PAGE, "http://localhost:3000"]), "--allowed-methods", '["POST"]',
        "--allow-credentials"])
    assert serve.config(args).cors == Cors((PAGE, "http://localhost:3000"), ("POST",), ("*",), True)
    assert serve.config(parser.parse_args(["serve"])).cors == Cors()
    monkeypatch.setattr(serve, "load_backend", lambda args: pytest.fail("loaded"))
    for flag, value in (("--allowed-origins", "*"), ("--allowed-headers", '["a", 1]'), ("--allowed-methods", '[""]'),
                        ("--allowed-origins", '{"a": 1}')):
        assert cli.main(["serve", flag, value]) == 1
        assert capsys.readouterr().err.strip() == (f"tokendance serve: {flag}: expected a JSON list of strings, "
                                                   f"""such as '["*"]', got {value!r}""")
