"""Structured outputs (backend/grammar.py): every constrained output matches its spec and
ends at the grammar's end, the rows without one are untouched, bad specs are refused."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tokendance.backend.api import InvalidRequest, SamplingParams, Structure
from tokendance.backend.engine import Engine
from tokendance.backend.grammar import mask

PROMPT = list(range(100, 140))
VOTE = {"type": "object", "additionalProperties": False, "required": ["vote", "n", "why"],
        "properties": {"vote": {"enum": ["yes", "no"]}, "n": {"type": "integer"},
                       "why": {"type": "string", "pattern": "^[a-z ]{0,12}$"}}}


def greedy(structure: Structure | None = None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 300), temperature=0, structure=structure, **kw)


def valid_vote(text: str) -> bool:
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(v, dict) and set(v) == {"vote", "n", "why"} and v["vote"] in ("yes", "no")
            and type(v["n"]) is int and re.fullmatch("[a-z ]{0,12}", v["why"]) is not None)


# The tiny random model would write whitespace forever where JSON allows any.
CASES = [  # (structure, does the text match)
    (Structure("json", json.dumps(VOTE), whitespace=False), valid_vote),
    (Structure("regex", r"[a-c]{2}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t) is not None),
    (Structure("choice", json.dumps(["alpha beta", 'say "hi"', "ünï"])),
     lambda t: t in ("alpha beta", 'say "hi"', "ünï")),
    (Structure("grammar", 'root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] [0-9]?'),
     lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", t) is not None),
]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16384)


@pytest.mark.parametrize("structure,ok", CASES, ids=["json", "regex", "choice", "grammar"])
def test_the_output_matches_its_spec_and_stops_at_its_end(engine, structure, ok):
    ids, text, reason = engine.generate([PROMPT], greedy(structure))[0]
    assert reason == "stop" and ok(text), text
    assert ids[-1] in engine.eos  # the grammar's end lets only an end-of-sequence token through
    plain = engine.generate([PROMPT], greedy(max_tokens=len(ids)))[0][1]
    assert not ok(plain)  # the tiny random model says something else unconstrained


def test_seeded_sampling_keeps_to_the_spec(engine):
    for seed in range(4):
        p = SamplingParams(max_tokens=300, temperature=1.0, seed=seed, structure=CASES[0][0])
        text, reason = engine.generate([PROMPT], p)[0][1:]
        assert reason == "stop" and valid_vote(text), text


def test_max_tokens_cuts_a_structured_output_as_length(engine):
    ids, text, reason = engine.generate([PROMPT], greedy(CASES[0][0], max_tokens=3))[0]
    assert reason == "length" and len(ids) == 3 and text.startswith("{")


@pytest.mark.parametrize("overlap", [False, True], ids=["stepwise", "lookahead"])
def test_a_mixed_batch_gives_each_what_it_gets_alone(tiny_llama, engine, overlap):
    """Constrained and free requests in one batch (and n = 2 of one spec): each row's
    mask is its own, and the free rows are not held to anything."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16384, overlap=overlap)
    params = [greedy(max_tokens=24), *(greedy(s) for s, _ in CASES), greedy(CASES[0][0]),
              SamplingParams(max_tokens=24, temperature=0.9, seed=3)]
    prompts = [PROMPT, PROMPT, [7, 8, 9], PROMPT[::2], [42] * 30, [5, 6], PROMPT]
    alone = [engine.generate([q], p)[0] for p, q in zip(params, prompts)]
    together = eng.generate(prompts, params)
    assert together == alone


def test_mask_changes_only_constrained_rows_and_leaves_its_input(engine):
    m = engine.grammars.matcher(Structure("choice", json.dumps(["yes", "no"])))
    logits = torch.randn(3, engine.mcfg.vocab_size)
    raw = logits.clone()
    out = mask(logits, [None, m, None])
    assert torch.equal(logits, raw)
    assert torch.equal(out[0], raw[0]) and torch.equal(out[2], raw[2])
    allowed = torch.isfinite(out[1]).nonzero()[:, 0].tolist()
    assert torch.equal(out[1, allowed], raw[1, allowed])
    texts = [engine.tokenizer.decode([t]) for t in allowed]
    assert 0 < len(allowed) < 10 and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


@pytest.mark.parametrize("structure,message", [
    (Structure("json", '{"type": 5}'), "invalid json for structured output: Type should be a string"),
    (Structure("json", "not json", "structured_outputs.json"), "invalid json"),
    (Structure("regex", "a[", "structured_outputs.regex"), "Unclosed '['"),
    (Structure("grammar", "root ::= x", "structured_outputs.grammar"), 'Rule "x" is not defined'),
], ids=["schema", "json-text", "regex", "grammar"])
def test_a_spec_that_does_not_compile_is_the_clients_mistake(engine, structure, message):
    with pytest.raises(InvalidRequest) as e:
        engine.check(PROMPT, greedy(structure))
    assert message in e.value.message and e.value.param == structure.param
    assert "/project/" not in e.value.message  # xgrammar's source location is left out
    with pytest.raises(InvalidRequest):
        engine.add("bad", PROMPT, greedy(structure))
    assert "bad" not in engine.seqs



def test_reused_requests_keep_to_their_spec(engine):
    """pic and collective sample a request's first token after its reuse prefill (the
    collector), the rest in decode steps: the grammar holds at both."""
    shared = list(range(300, 360))
    prompts = [[11, 12, 13] + shared + [20 + i] for i in range(3)]
    spans = [[(3, 63)]] * 3
    for mode in ("pic", "collective"):
        outs = engine.generate(prompts, greedy(CASES[0][0]), mode=mode, shared=spans)
        assert all(r == "stop" and valid_vote(t) for _, t, r in outs), outs


@pytest.mark.parametrize("overlap", [False, True], ids=["stepwise", "lookahead"])
def test_a_grammar_after_a_marker_holds_only_what_follows_it(tiny_llama, engine, overlap):
    """Structure.after (a reasoning model's "</think>"): the output is free up to the
    marker's tokens and held to the spec from there; without the marker, never held."""
    eng = engine if not overlap else Engine(model=str(tiny_llama), dtype="float32", kv_tokens=16384, overlap=True)
    marker = " Meanwhile"
    (tok,) = eng.tokenizer.encode(marker, add_special_tokens=False)  # one token, forced first by its bias
    choice = Structure("choice", json.dumps(["yes", "no"]), after=marker)
    ids, text, reason = eng.generate([PROMPT], greedy(choice, logit_bias={tok: 100.0}))[0]
    assert reason == "stop" and text in (marker + "yes", marker + "no"), text
    assert ids[0] == tok and ids[-1] in eng.eos
    free = eng.generate([PROMPT], greedy(max_tokens=12, logit_bias={tok: 100.0}))[0]
    assert free[0] == [tok] * 12  # unconstrained, the bias alone picks every token
    later = Structure("choice", json.dumps(["yes", "no"]), after="</think>")
    assert eng.generate([PROMPT], greedy(later, max_tokens=12))[0] == \
        eng.generate([PROMPT], greedy(max_tokens=12))[0]  # the marker never comes: never held
