"""The model's default sampling (backend/generation.py), as vLLM's --generation-config
reads it, through the proxy to a request that leaves a field out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokendance.backend.generation import check, defaults, ends
from tokendance.examples import cli

# a generation_config.json of the kind instruct models ship: sampling beside token ids
QWEN = {"bos_token_id": 151643, "pad_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "transformers_version": "4.37.0"}


def folder(tmp_path: Path, config: dict | str, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def test_the_model_folders_values_that_differ_from_transformers_defaults(tmp_path):
    d = folder(tmp_path, QWEN)
    assert defaults(d) == {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert isinstance(defaults(d)["top_k"], int)
    neutral = folder(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_new_tokens": 300}, "n")
    assert defaults(neutral) == {"max_tokens": 300}  # a default value is no advice; max_new_tokens is max_tokens
    assert defaults(tmp_path / "none") == {}  # no file, no defaults


def test_the_end_tokens_as_the_engine_takes_them(tmp_path):
    """A vLLM server's model's ends, for the proxy's beam search: the generation config's
    eos_token_id over the model config's, with the tokenizer's."""
    class Tok:
        eos_token_id = 2

    d = folder(tmp_path, QWEN)
    (d / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert ends(d, Tok()) == (2, 151643, 151645)
    (d / "generation_config.json").unlink()
    assert ends(d, Tok()) == (2, 7)
    Tok.eos_token_id = None
    assert ends(tmp_path / "none", Tok()) == ()


def test_vllm_a_folder_and_overrides(tmp_path):
    d, other = folder(tmp_path, QWEN), folder(tmp_path, {"temperature": 0.3}, "other")
    assert defaults(d, "vllm") == {}
    assert defaults(d, str(other)) == {"temperature": 0.3}
    assert defaults(d, "auto", {"temperature": 0.5, "max_new_tokens": 64}) == {
        "repetition_penalty": 1.05, "temperature": 0.5, "top_p": 0.8, "top_k": 20, "max_tokens": 64}
    assert defaults(d, "vllm", {"top_k": 5}) == {"top_k": 5}


@pytest.mark.parametrize("choice,override,message", [
    ("/no/such/folder", None, "--generation-config is auto, vllm or a folder: no such folder: /no/such/folder"),
    ("auto", {"temprature": 0.5}, "--override-generation-config: unknown temprature"),
    ("auto", {"temperature": 3}, "generation config: temperature must be between 0 and 2"),
    ("auto", {"top_k": 2.5}, "generation config: top_k must be an integer, got 2.5"),
    ("auto", {"top_p": "high"}, "generation config: top_p must be a number, got 'high'"),
])
def test_bad_flags_fail_in_one_line(choice, override, message):
    with pytest.raises(ValueError) as e:
        check(choice, override)
    assert str(e.value).startswith(message)


def test_a_bad_file_fails_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        defaults(folder(tmp_path, "{not json"))
    with pytest.raises(ValueError, match="top_p must be in"):
        defaults(folder(tmp_path, {"top_p": 0}, "zero"))


@pytest.mark.parametrize("argv,message", [
    (["serve", "--override-generation-config", "[1]"], "expected a JSON object"),
    (["serve", "--override-generation-config", '{"temprature": 1}'], "unknown temprature"),
    (["serve", "--generation-config", "/no/such/folder"], "no such folder: /no/such/folder"),
    (["engine", "--override-generation-config", '{"top_p": 2}'], "top_p must be in (0, 1]"),
    (["serve", "--engine", "http://127.0.0.1:9", "--generation-config", "vllm"],
     "--generation-config set the engine: with --engine, give them to `tokendance engine`"),
    (["serve", "--vllm", "http://127.0.0.1:9", "--generation-config", "vllm"],  # the proxy's, for vLLM
     "no vLLM server at http://127.0.0.1:9"),
])
def test_the_cli_says_what_is_wrong_before_any_model_loads(capsys, argv, message):
    try:
        assert cli.main(argv) == 1
    except SystemExit as e:  # argparse's usage error
        assert e.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
