"""The command line's logs: stderr, and a failure's traceback without its frames' locals
(they held requests' prompts and whole tensors)."""

from __future__ import annotations

import pytest
import structlog

from tokendance.backend import logs


@pytest.fixture
def configured():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_a_failure_is_logged_with_pythons_traceback_and_no_locals(configured, capsys):
    logs.to_stderr("info")

    def fail() -> None:
        prompt = "the user's private prompt"  # a local the log must not print
        raise RuntimeError("the step failed" if prompt else "")

    try:
        fail()
    except RuntimeError:
        structlog.get_logger("t").exception("engine step failed", rid="r1")
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err
    assert "engine step failed" in err and "rid=r1" in err
    assert "Traceback (most recent call last):" in err and "RuntimeError: the step failed" in err
    assert "private prompt" not in err and len(err.splitlines()) < 20
    assert "\x1b[" not in err  # no colours where stderr is not a terminal


def test_the_level_filters(configured, capsys):
    logs.to_stderr("warning")
    structlog.get_logger("t").info("quiet")
    structlog.get_logger("t").warning("loud")
    err = capsys.readouterr().err
    assert "loud" in err and "quiet" not in err


@pytest.fixture
def http_log():
    import logging

    log = logging.getLogger("aiohttp")
    saved = log.level, list(log.handlers), log.propagate
    yield log
    log.setLevel(saved[0])
    log.handlers[:] = saved[1]
    log.propagate = saved[2]


def test_the_http_servers_own_log_takes_vllms_uvicorn_level(http_log, capsys):
    """--uvicorn-log-level: aiohttp's errors on stderr from the level given, once each."""
    logs.http("info")
    logs.http("error")
    server = __import__("logging").getLogger("aiohttp.server")
    server.error("Error handling request")
    server.warning("a slow client")
    err = capsys.readouterr().err
    assert err.count("Error handling request") == 1 and "a slow client" not in err
    logs.http("critical")
    server.error("Error handling request")
    assert capsys.readouterr().err == ""
    logs.http("trace")
    server.debug("a frame")
    assert "[DEBUG] aiohttp.server: a frame" in capsys.readouterr().err
