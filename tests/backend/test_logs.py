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
