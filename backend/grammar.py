"""Structured outputs: a request's output held to a JSON schema, any JSON object, a
regular expression, a choice of strings, an EBNF grammar or a structural tag, as vLLM's
structured outputs do it, by xgrammar (the library vLLM uses).

A `Structure` (backend/api.py) compiles once per tokenizer into a grammar, cached; each
sequence gets a matcher of it. Before every sampling the matcher's bitmask sets the
logits of the tokens the grammar forbids to -inf; the sampled token then advances the
matcher. Once the grammar is complete only an end-of-sequence token is allowed, so a
request ends (`finish_reason` "stop") with a whole match, unless `max_tokens` cuts it
first ("length"), as in vLLM.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import torch

from tokendance.backend.api import InvalidRequest, Structure

_CACHE = 64  # compiled grammars kept per tokenizer (schemas recur across a simulation's rounds)


def _xgrammar(param: str = "response_format") -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequest("structured outputs need xgrammar on the server: "
                             "pip install 'tokendance[structured]'", param) from None
    return xgrammar


def _reason(exc: Exception) -> str:
    """xgrammar's message without its '[time] /project/cpp/file.cc:line: ' prefix."""
    text = str(exc).strip()
    return re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: (Check failed: \(.*?\) is false: )?", "", text)


class Grammars:
    """Compiled grammars for one tokenizer. Thread-safe: the proxy compiles to check a
    request while the engine's thread makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int] | None = None):
        # stop_ids: the engine's end-of-sequence tokens; None: the tokenizer's (a check only)
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_ids = sorted(stop_ids) if stop_ids else None
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, s: Structure) -> Any:
        """The compiled grammar; InvalidRequest if the spec is not one."""
        key = (s.kind, s.spec, s.whitespace)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiled = self._compile(s)
            self._cache[key] = compiled
            if len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
            return compiled

    def matcher(self, s: Structure) -> Any:
        return _xgrammar().GrammarMatcher(self.compile(s))

    def _compile(self, s: Structure) -> Any:
        xgr = _xgrammar(s.param)
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        c = self._compiler
        try:
            if s.kind in ("json", "json_object"):  # OpenAI's json_object is an object
                return c.compile_json_schema(s.spec if s.kind == "json" else '{"type": "object"}',
                                             any_whitespace=s.whitespace)
            if s.kind == "regex":
                return c.compile_regex(s.spec)
            if s.kind == "choice":
                # EBNF string literals take JSON's escapes (a regex would need xgrammar's own)
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(x, ensure_ascii=False)
                                                                 for x in json.loads(s.spec)))
            if s.kind == "grammar":
                return c.compile_grammar(s.spec)
            if s.kind == "structural_tag":
                return c.compile_structural_tag(s.spec)
        except (RuntimeError, ValueError) as exc:  # xgrammar's parse errors
            raise InvalidRequest(f"invalid {s.kind} for structured output: {_reason(exc)}", s.param) from None
        raise InvalidRequest(f"unknown structured output kind {s.kind!r}", s.param)


def mask(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """The logits with every token a row's grammar forbids at -inf (rows whose matcher
    is None unchanged); `logits` [S, V] itself stays as it was."""
    xgr = _xgrammar()
    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), indices=rows)
    return out
