"""vLLM's `--config FILE`: a YAML mapping of a command's long options, without their
dashes (`port: 8001`, `served-model-name: [a, b]`, `enable-log-requests: true`). Each
option the command line does not set is taken from the file (the command line takes
precedence); `model` is the MODEL argument, which a MODEL on the command line replaces."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

FLAG = "--config"


def add_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(FLAG, default=None, metavar="YAML",
                   help="read options from this YAML file (long names without dashes, e.g. port: 8001); "
                        "the command line's own take precedence")


def takes(p: argparse.ArgumentParser) -> bool:
    return any(FLAG in a.option_strings for a in p._actions)


def read(argv: list[str], p: argparse.ArgumentParser) -> tuple[list[str], dict[str, Any]]:
    """argv (a command and its arguments) less --config FILE, and the options the file
    sets, by their parser's names. ValueError, one line, for a file or an option that
    cannot be read (argparse's message for a value its flag refuses)."""
    rest, path = _without_config(argv[1:])
    if path is None:
        return argv, {}
    by_flag = {s: a for a in p._actions for s in a.option_strings}
    words: list[str] = []
    for key, value in _read(path).items():
        name = str(key).replace("_", "-")
        action = by_flag.get(f"--{name}")
        if action is None or name in ("config", "help"):
            raise ValueError(f"{FLAG} {path}: unknown option {key!r} (options are the long flags "
                             "without their dashes)")
        words += _words(f"--{name}", action, value, path)
    return [argv[0], *rest], vars(_given(p, words))


def merge(args: argparse.Namespace, p: argparse.ArgumentParser, argv: list[str], filed: dict[str, Any]) -> None:
    """The file's options set on `args` where the command line (argv, the command and its
    arguments) did not set them; a MODEL or --model there replaces the file's model."""
    given = vars(_given(p, argv[1:]))
    if "model_tag" in given:
        filed.pop("model", None)
    for name, value in filed.items():
        if name not in given:
            setattr(args, name, value)


def _given(p: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """Only what `words` set: `p` parses them with no defaults."""
    saved = [(a, a.default) for a in p._actions]
    try:
        for a, _ in saved:
            a.default = argparse.SUPPRESS
        return p.parse_args(words)
    finally:
        for a, default in saved:
            a.default = default


def _without_config(args: list[str]) -> tuple[list[str], str | None]:
    rest, path = [], None
    it = iter(args)
    for a in it:
        if a == FLAG:
            path = next(it, None)
            if path is None:
                raise ValueError(f"{FLAG} needs a YAML file")
        elif a.startswith(FLAG + "="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
    return rest, path


def _read(path: str) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text())
    except OSError as e:
        raise ValueError(f"{FLAG} {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{FLAG} {path}: not YAML ({' '.join(str(e).split())})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{FLAG} {path}: expected a mapping of options, got a {type(data).__name__}")
    return data


def _words(flag: str, action: argparse.Action, value: Any, path: str) -> list[str]:
    """The command-line words that set `action` to `value`."""
    if action.nargs == 0:  # a switch: store_true / store_false, or --x / --no-x
        if not isinstance(value, bool):
            raise ValueError(f"{FLAG} {path}: {flag[2:]} is a switch: give true or false, not {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []  # `disable-log-requests: true` is --disable-log-requests
    if isinstance(value, list) and (action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)):
        if not value:
            return []
        words = [_word(v) for v in value]
        return [flag, *words] if action.nargs in ("+", "*") else [w for v in words for w in (flag, v)]
    return [flag, _word(value)]


def _word(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value)  # JSON options: --hf-overrides, --allowed-origins, ...
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
