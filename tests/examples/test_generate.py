"""`tokendance generate`: one prompt through the engine; the answer alone on stdout."""

from __future__ import annotations

import io

from tokendance.examples import cli


def test_the_answer_alone_goes_to_stdout(tiny_llama, capsys) -> None:
    argv = ["generate", "Name three primes.", "--model", str(tiny_llama), "--max-tokens", "5", "--stats"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "engine ready" not in out and "engine ready" in err  # logs on stderr
    assert out.endswith("\n") and out.count("\n") <= 6  # the answer: 5 tokens of text
    assert "prompt " in err and "5 generated" in err


def test_raw_text_from_stdin_gives_the_same_answer_as_the_argument(tiny_llama, capsys, monkeypatch) -> None:
    base = ["--model", str(tiny_llama), "--max-tokens", "4", "--raw", "--seed", "3", "--temperature", "0.8"]
    assert cli.main(["generate", "Once upon a time", *base]) == 0
    first = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("Once upon a time"))
    assert cli.main(["generate", "-", *base]) == 0
    assert capsys.readouterr().out == first


def test_bad_sampling_is_one_line_before_the_model_loads(capsys) -> None:
    argv = ["generate", "hi", "--model", "/nonexistent/model", "--temperature", "-1"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "temperature" in err and "\n" not in err
