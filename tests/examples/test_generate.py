"""`tokendance generate`: one prompt through the engine; the answer alone on stdout."""

from __future__ import annotations

import io

import pytest

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


@pytest.mark.parametrize("flag,param", [("--presence-penalty", "presence_penalty"),
                                        ("--frequency-penalty", "frequency_penalty"),
                                        ("--repetition-penalty", "repetition_penalty"),
                                        ("--min-p", "min_p"), ("--min-tokens", "min_tokens")])
def test_a_bad_penalty_is_one_line_naming_it(capsys, flag, param) -> None:
    assert cli.main(["generate", "hi", "--model", "/nonexistent/model", flag, "-3"]) == 1
    err = capsys.readouterr().err.strip()
    assert param in err and "\n" not in err


def test_a_repetition_penalty_changes_the_answer(tiny_llama, capsys) -> None:
    base = ["generate", "Once upon a time", "--model", str(tiny_llama), "--max-tokens", "16", "--raw"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out
    assert cli.main([*base, "--repetition-penalty", "0.5"]) == 0
    assert capsys.readouterr().out != plain


def test_min_tokens_holds_off_a_stop_string(tiny_llama, capsys) -> None:
    base = ["generate", "Once upon a time", "--model", str(tiny_llama), "--raw", "--max-tokens", "12"]
    assert cli.main(base) == 0
    plain = capsys.readouterr().out.rstrip("\n")
    stop = plain[1:3]
    assert cli.main([*base, "--stop", stop]) == 0
    cut = capsys.readouterr().out.rstrip("\n")
    assert cli.main([*base, "--stop", stop, "--min-tokens", "6"]) == 0
    held = capsys.readouterr().out.rstrip("\n")
    assert len(cut) < 3 and plain.startswith(held) and len(held) > len(cut) + len(stop)
