"""vLLM's `--config FILE` for `serve` and `engine`: a YAML mapping of long options, each
taken where the command line does not set it; bad files are one line."""

from __future__ import annotations

import pytest

from tokendance.backend import flags
from tokendance.examples import cli
from tokendance.proxy import serve


@pytest.fixture
def seen(monkeypatch) -> list:
    """The parsed arguments `serve` or `engine` would start with (nothing starts)."""
    got = []

    def stop(args):
        got.append(args)
        return 0

    monkeypatch.setattr(serve, "main", stop)
    from tokendance.backend import endpoint

    monkeypatch.setattr(endpoint, "main", stop)
    return got


def run(tmp_path, text: str, *argv: str, command: str = "serve") -> int:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return cli.main([command, "--config", str(path), *argv])


def test_options_from_the_file(tmp_path, seen):
    assert run(tmp_path, """
model: /models/a
port: 8123
served-model-name: [one, two]
api_key: [k1, k2]
enable-log-requests: true
enable-prefix-caching: false
disable-log-requests: false
hf-overrides: {max_position_embeddings: 4096}
allowed-origins: ["https://a.example"]
max-model-len: 32k
block-size: 32
""") == 0
    a = seen[0]
    assert (a.model, a.port, a.served_model_name, a.api_key) == ("/models/a", 8123, ["one", "two"], ["k1", "k2"])
    assert a.enable_log_requests and a.enable_prefix_caching is False
    assert a.hf_overrides == {"max_position_embeddings": 4096}
    assert serve.config(a).cors.origins == ("https://a.example",)
    assert flags.engine_options(a)["max_model_len"] == 32000 and a.block_size == 32


def test_the_command_line_takes_precedence(tmp_path, seen):
    text = "model: /models/a\nport: 8123\nenable-log-requests: true\n"
    assert run(tmp_path, text, "--port", "9000", "--no-enable-log-requests") == 0
    assert (seen[0].model, seen[0].port, seen[0].enable_log_requests) == ("/models/a", 9000, False)
    assert run(tmp_path, text, "/models/b") == 0  # MODEL replaces the file's, as in vLLM
    assert flags.model(seen[1]) == "/models/b"
    assert run(tmp_path, text, "--model", "/models/c") == 0
    assert flags.model(seen[2]) == "/models/c"
    assert run(tmp_path, "", "--port", "9001") == 0  # an empty file gives nothing
    assert seen[3].port == 9001
    listed = "served-model-name: [a, b]\napi-key: [k1, k2]\n"
    assert run(tmp_path, listed, "/models/d", "--api-key", "k3") == 0  # a list does not take MODEL in
    a = seen[4]
    assert (flags.model(a), a.served_model_name, a.api_key) == ("/models/d", ["a", "b"], ["k3"])


def test_engine_takes_it_too(tmp_path, seen):
    assert run(tmp_path, "port: 8200\nkv-tokens: 4k\n", command="engine") == 0
    assert (seen[0].port, seen[0].kv_tokens) == (8200, 4000)


@pytest.mark.parametrize("text,message", [
    ("prot: 8000\n", "unknown option 'prot'"),
    ("config: other.yaml\n", "unknown option 'config'"),
    ("enable-log-requests: 1\n", "enable-log-requests is a switch: give true or false, not 1"),
    ("- port\n- 8000\n", "expected a mapping of options, got a list"),
    ("port: [8000\n", "not YAML"),
])
def test_a_bad_file_is_one_line(tmp_path, capsys, seen, text, message):
    assert run(tmp_path, text) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("tokendance serve: --config")
    assert not seen


def test_a_missing_file_and_a_bad_value_are_one_line(tmp_path, capsys, seen):
    assert cli.main(["serve", "--config", str(tmp_path / "none.yaml")]) == 1
    assert "No such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse's own message, as on the command line
        run(tmp_path, "port: eighty\n")
    err = capsys.readouterr().err.strip()
    assert "argument --port: invalid int value: 'eighty'" in err and "\n" not in err
