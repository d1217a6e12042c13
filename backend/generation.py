"""The model's recommended sampling, as vLLM's `--generation-config` reads it: the
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens)
of the model folder's generation_config.json, where they differ from transformers'
defaults. A request that leaves one of them out gets the model's value instead of the
neutral one (proxy/schemas.py); `--generation-config vllm` turns that off, a folder
reads another generation_config.json, and `--override-generation-config` sets values
over either."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import structlog

from tokendance.backend.api import InvalidRequest, SamplingParams

log = structlog.get_logger(__name__)

# transformers' GenerationConfig defaults: a value equal to its default is no advice
NEUTRAL: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                           "repetition_penalty": 1.0, "max_new_tokens": None}
CHOICES = ("auto", "vllm")  # the model folder's, or none; anything else: a folder


def check(choice: str, override: dict[str, Any] | None) -> None:
    """ValueError, in one line, for flags that cannot be used (before a model loads)."""
    if choice not in CHOICES and not Path(choice).expanduser().is_dir():
        raise ValueError(f"--generation-config is auto, vllm or a folder: no such folder: {choice}")
    unknown = sorted(set(override or ()) - set(NEUTRAL))
    if unknown:
        raise ValueError(f"--override-generation-config: unknown {', '.join(unknown)}; "
                         f"it sets {', '.join(NEUTRAL)}")
    _typed(_named(override or {}))


def defaults(model_folder: str | Path, choice: str = "auto", override: dict[str, Any] | None = None
             ) -> dict[str, float]:
    """The sampling defaults a backend advertises (ModelInfo.sampling), by the names of
    SamplingParams; ValueError, in one line, for a file or value that cannot be used."""
    check(choice, override)
    given: dict[str, Any] = {}
    if choice != "vllm":
        folder = Path(model_folder if choice == "auto" else choice).expanduser()
        given = {k: v for k, v in _read(folder / "generation_config.json").items()
                 if k in NEUTRAL and v is not None and v != NEUTRAL[k]}
    out = _typed(_named({**given, **(override or {})}))
    if out:
        log.warning("requests that leave these out sample with the generation config's values "
                    "(--generation-config vllm: the neutral ones)", **out)
    return out


def ends(model_folder: str | Path, tokenizer: Any) -> tuple[int, ...]:
    """The tokens that end a sequence (the engine's, and a vLLM server's model's): the
    generation config's eos_token_id (else the model config's), and the tokenizer's."""
    folder = Path(model_folder).expanduser()
    eos = _read(folder / "config.json").get("eos_token_id")
    eos = _read(folder / "generation_config.json").get("eos_token_id", eos)
    ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _named(values: dict[str, Any]) -> dict[str, Any]:
    return {("max_tokens" if k == "max_new_tokens" else k): v for k, v in values.items() if v is not None}


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def _typed(values: dict[str, Any]) -> dict[str, float]:
    """`values` as SamplingParams takes them (top_k and max_tokens integers), checked."""
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"generation config: {k} must be a number, got {v!r}")
        if k in ("top_k", "max_tokens") and v != int(v):
            raise ValueError(f"generation config: {k} must be an integer, got {v!r}")
    out = {k: int(v) if k in ("top_k", "max_tokens") else float(v) for k, v in values.items()}
    try:
        SamplingParams(**out).validate()
    except InvalidRequest as e:
        raise ValueError(f"generation config: {e.message}") from None
    return out
