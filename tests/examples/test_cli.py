"""The `tokendance` dispatcher: lazy subcommands, one-line errors."""

from __future__ import annotations

import argparse
import subprocess
import sys
import types

import pytest

from tokendance.examples import cli


def _fake(monkeypatch: pytest.MonkeyPatch, run) -> None:
    mod = types.ModuleType("tokendance_fake_cmd")

    def add_parser(subs: argparse._SubParsersAction) -> argparse.ArgumentParser:
        p = subs.add_parser("fake", help="a fake")
        p.add_argument("--n", type=int, default=1)
        return p

    mod.add_parser = add_parser
    mod.main = run
    monkeypatch.setitem(sys.modules, "tokendance_fake_cmd", mod)
    monkeypatch.setitem(cli.COMMANDS, "fake", ("tokendance_fake_cmd", "a fake"))


def test_help_is_instant_and_imports_no_subcommand() -> None:
    code = (
        "import sys\n"
        "from tokendance.examples.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'aiohttp', 'tokendance.proxy.serve') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in cli.COMMANDS:
        assert name in out.stdout


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["dance"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'dance'" in err


def test_no_command_prints_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_missing_module_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setitem(cli.COMMANDS, "fake", ("tokendance.nothing_here", "gone"))
    assert cli.main(["fake"]) == 2
    err = capsys.readouterr().err
    assert err == "tokendance fake: not available in this install (tokendance.nothing_here is missing)\n"


def test_missing_dependency_names_the_extra(monkeypatch, capsys) -> None:
    def boom(args: argparse.Namespace) -> int:
        return 0

    _fake(monkeypatch, boom)
    real = cli.importlib.import_module

    def imp(name: str):
        if name == "tokendance_fake_cmd":
            raise ModuleNotFoundError("No module named 'langchain_openai'", name="langchain_openai")
        return real(name)

    monkeypatch.setattr(cli.importlib, "import_module", imp)
    assert cli.main(["fake"]) == 2
    assert "pip install 'tokendance[langgraph]'" in capsys.readouterr().err


def test_runs_subcommand(monkeypatch) -> None:
    seen: list[int] = []
    _fake(monkeypatch, lambda a: seen.append(a.n) or 3)
    assert cli.main(["fake", "--n", "7"]) == 3
    assert seen == [7]


def test_bad_argument_is_one_line(monkeypatch, capsys) -> None:
    _fake(monkeypatch, lambda a: 0)
    with pytest.raises(SystemExit) as e:
        cli.main(["fake", "--n", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid int value" in err


@pytest.mark.parametrize("error", [FileNotFoundError("no such model: /nope"),
                                   MemoryError("host tier: cannot pin 64.00 GiB")])
def test_user_error_is_one_line(monkeypatch, capsys, error) -> None:
    def run(args: argparse.Namespace) -> int:
        raise error

    _fake(monkeypatch, run)
    assert cli.main(["fake"]) == 1
    err = capsys.readouterr().err
    assert err == f"tokendance fake: {error}\n"


def test_debug_shows_traceback(monkeypatch) -> None:
    def run(args: argparse.Namespace) -> int:
        raise ValueError("bad")

    _fake(monkeypatch, run)
    monkeypatch.setenv("TOKENDANCE_DEBUG", "1")
    with pytest.raises(ValueError):
        cli.main(["fake"])


@pytest.mark.parametrize("argv,what", [(["caf\udce9"], "the prompt"), (["hi", "--system", "\udce9"], "--system")])
def test_generate_refuses_text_that_is_not_utf8_before_loading(capsys, argv, what) -> None:
    assert cli.main(["generate", *argv, "--model", "/nonexistent"]) == 1
    assert capsys.readouterr().err == f"tokendance generate: {what} is not UTF-8 text\n"
