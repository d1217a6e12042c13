"""Misuse of the framework-free helpers: each is one clear exception, raised at once."""

from __future__ import annotations

import socket

import pytest

from tokendance.adapters.rounds import ProxyError, Rounds, served_model
from tokendance.adapters.tags import body, headers, shared


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url", ["http://127.0.0.1:{closed}", "127.0.0.1:8000"])
def test_a_proxy_that_cannot_be_reached_is_a_connection_error_naming_it(url: str) -> None:
    """Was urllib's URLError ('<urlopen error [Errno 111] Connection refused>'), with no URL."""
    url = url.format(closed=closed_port())
    for call in (lambda: Rounds("s", url).announce(1, ["a"]), lambda: served_model(url)):
        with pytest.raises(ConnectionError, match="cannot reach the TokenDance proxy at .*127.0.0.1"):
            call()


@pytest.mark.parametrize("number", [1.5, 2.0, -1, True])
def test_a_round_that_is_not_a_non_negative_int_is_the_proxys_400(proxy_url: str, number) -> None:
    """int(round) made 1.5 round 1 and True round 1, silently."""
    with pytest.raises(ProxyError, match="400: round must be a non-negative integer"):
        Rounds("r", proxy_url).announce(number, ["a"])
    assert Rounds("r", proxy_url).announce("3", ["a"])["round"] == 3


def test_agents_given_as_one_string_is_a_type_error(proxy_url: str) -> None:
    """list("alice") announced a, l, i, c, e: the round then waited for its timeout."""
    with pytest.raises(TypeError, match="agents must be a list of names"):
        Rounds("g", proxy_url).announce(1, "alice")
    assert Rounds("g", proxy_url).announce(1, ("alice",))["expected"] == ["alice"]


@pytest.mark.parametrize("name", ["d\u00e9bat", "\u8a0e\u8ad6", "a\nb", "a\tb"])
def test_a_name_headers_cannot_carry_is_a_value_error_pointing_to_the_body(proxy_url: str, name: str) -> None:
    """httpx raised UnicodeEncodeError ('ascii' codec ...) from deep inside the first request
    of every framework adapter; a newline became openai's bare 'Connection error.'"""
    for tags in ({"session": name}, {"session": "s", "agent": name}):
        with pytest.raises(ValueError, match="printable ASCII only.*tags.body"):
            headers(**tags)
    if name.isprintable():  # the proxy takes UTF-8 names in the body
        openai = pytest.importorskip("openai")
        c = openai.OpenAI(base_url=proxy_url, api_key="k", max_retries=0)
        Rounds(name, proxy_url).announce(1, [name])  # released on arrival, not after the timeout
        c.chat.completions.create(model="echo", max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                  extra_body=body(name, name, round=1))
        assert Rounds(name, proxy_url).stats(1)["agents"] == [name]


@pytest.mark.parametrize("block", [1, None, b"bytes", ["a"]])
def test_a_shared_block_that_is_not_text_is_a_type_error(block) -> None:
    """Was AttributeError: 'int' object has no attribute 'replace', from proxy/segment.py."""
    with pytest.raises(TypeError, match="shared\\(\\) takes str blocks"):
        shared("ok", block)
