"""`tokendance`: one console script, one subcommand per module.

Each subcommand lives in its own module, which offers `add_parser(subparsers)` and
`main(args) -> int | None`. Modules are imported only when their subcommand runs, so
`tokendance --help` is instant and a missing optional piece costs one line, not a
traceback. User mistakes print one line on stderr and exit non-zero; set
TOKENDANCE_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import NoReturn, Sequence

from tokendance.backend import config_file, logs

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tokendance.backend.cli", "run the engine on prompts, no server"),
    "serve": ("tokendance.proxy.serve", "start the OpenAI-compatible proxy"),
    "engine": ("tokendance.backend.endpoint", "start the engine alone, for `serve --engine URL`"),
    "quantize": ("tokendance.backend.checkpoint", "write a model again with 8-bit float projections"),
    "simulate": ("tokendance.examples.simulate", "run debate / town / society, print rounds"),
    "bench": ("tokendance.bench.cli", "measure reuse modes side by side"),
}

# a missing third-party module -> the extra that brings it
EXTRAS = {
    "triton": "triton",
    "langgraph": "langgraph",
    "langchain_openai": "langgraph",
    "camel": "camel",
    "autogen_agentchat": "autogen",
    "autogen_ext": "autogen",
    "openai": "test",
}


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """Reports usage errors in one line. Subparsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _top() -> Parser:
    p = Parser(prog="tokendance", description="Multi-agent LLM serving with collective KV reuse.")
    subs = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, text) in COMMANDS.items():
        subs.add_parser(name, help=text, add_help=False)
    return p


def _missing(name: str, err: ModuleNotFoundError) -> str:
    gone = err.name or "?"
    if gone == COMMANDS[name][0] or gone.startswith("tokendance."):
        return f"tokendance {name}: not available in this install ({gone} is missing)"
    extra = EXTRAS.get(gone.split(".")[0])
    hint = f"pip install 'tokendance[{extra}]'" if extra else f"pip install {gone.split('.')[0]}"
    return f"tokendance {name}: needs the module {gone!r} ({hint})"


def load(name: str) -> ModuleType:
    """The module of subcommand `name`; CliError when it cannot be imported."""
    try:
        mod = importlib.import_module(COMMANDS[name][0])
    except ModuleNotFoundError as e:
        raise CliError(_missing(name, e)) from e
    if not hasattr(mod, "add_parser") or not hasattr(mod, "main"):
        raise CliError(f"tokendance {name}: {mod.__name__} offers no add_parser/main")
    return mod


def _fail(message: str, code: int) -> int:
    print(message, file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top()
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv)  # --help / unknown flags exit here
        top.print_help(sys.stderr)
        return 2
    name = argv[0]
    if name not in COMMANDS:
        return _fail(f"tokendance: unknown command {name!r} (choose from {', '.join(COMMANDS)})", 2)
    debug = os.environ.get("TOKENDANCE_DEBUG") == "1"
    logs.to_stderr()  # `serve` and `simulate` set their --log-level over it
    try:
        mod = load(name)
        parser = Parser(prog="tokendance")
        sub = mod.add_parser(parser.add_subparsers(dest="command"))
        filed = {}
        if sub is not None and config_file.takes(sub):
            argv, filed = config_file.read(argv, sub)
        args = parser.parse_args(argv)
        if filed:
            config_file.merge(args, sub, argv, filed)
        code = mod.main(args)
    except KeyboardInterrupt:
        return _fail("tokendance: interrupted", 130)
    except CliError as e:
        if debug:
            raise
        return _fail(str(e), 2)
    except (OSError, ValueError, MemoryError) as e:  # MemoryError: e.g. a host tier that cannot be had
        if debug:
            raise
        return _fail(f"tokendance {name}: {e or type(e).__name__}", 1)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
