"""What a structured output costs the engine: a round of agents answering with a JSON
action under a schema, against the same round unconstrained with the same work.

    tokendance bench structured [--model PATH] [--dtype float32] [--batch 1,8] [--repeats 5]
                                [--spec json|tools]

For each batch size B: B agents' chat prompts asking for a JSON action are generated
greedily under the schema (`response_format` json_schema, whitespace allowed as in
vLLM); then the same prompts unconstrained, each with `ignore_eos` and `max_tokens` set
to the length its constrained answer had. Both runs prefill the same prompts and decode
the same number of tokens per request at the same context lengths, so they differ only
by the grammar: the bitmask filled and applied each step, the tokens accepted, and the
lookahead (backend/lookahead.py) a constrained step cannot take. Runs alternate; medians
of the repeats, after one warm-up pass. Also timed: compiling the schema for the
tokenizer the first time (later requests hit the cache).

`--spec tools`: instead of the schema, the structural tag `tool_choice` auto holds an
answer to when a tool is `strict` (proxy/tools.py), for two tools of which one is strict:
the answers are free text unless they begin a call, so this times what a strict tool
costs the answers that call nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from tokendance.backend.prompt import render_chat
from tokendance.bench.options import counts, positive

ACTION = {
    "type": "object", "additionalProperties": False, "required": ["agent", "action", "target", "say"],
    "properties": {
        "agent": {"type": "string"},
        "action": {"enum": ["move", "trade", "talk", "rest"]},
        "target": {"type": "string"},
        "say": {"type": "string"},
    },
}
NAMES = ["Ada", "Bo", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Max", "Ned", "Oz", "Pia"]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=counts, default=[1, 8], help="agents per round, e.g. 1,8")
    p.add_argument("--repeats", type=positive, default=5)
    p.add_argument("--max-tokens", type=positive, default=96)
    p.add_argument("--spec", choices=("json", "tools"), default="json",
                   help="the JSON action's schema, or auto's structural tag for a strict tool")


def tools_tag():  # -> Structure
    from tokendance.proxy import tools as t

    town = t.Function(name="go", strict=True, parameters={
        "type": "object", "additionalProperties": False, "required": ["town"],
        "properties": {"town": {"enum": ["Riverton", "Hillcrest"]}}})
    note = t.Function(name="note", parameters={"type": "object"})
    return t.check([t.Tool(type="function", function=town), t.Tool(type="function", function=note)],
                   "auto", None).structure()


def main(args: argparse.Namespace) -> int:
    from tokendance.backend.api import SamplingParams, Structure
    from tokendance.backend.engine import Engine
    from tokendance.backend.grammar import Grammars

    engine = Engine(model=args.model, dtype=args.dtype)
    schema = Structure("json", json.dumps(ACTION)) if args.spec == "json" else tools_tag()
    t0 = time.perf_counter()
    Grammars(engine.tokenizer, engine.mcfg.vocab_size, sorted(engine.eos)).compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    print(f"model {engine.name}, {engine.device.type}, {args.dtype}; {args.spec} spec compiled in "
          f"{compile_ms:.1f} ms (first time, tokenizer info included)")
    print("| agents | tokens | constrained ms | free ms | constrained / free | ms per token, constrained / free |")
    print("|---|---|---|---|---|---|")
    for b in args.batch:
        prompts = [engine.encode(render_chat(engine.tokenizer, [{"role": "user", "content": (
            f"You are {NAMES[i % len(NAMES)]} in a market town. Reply with your next action as JSON with "
            "agent, action (move, trade, talk or rest), target and say.")}])) for i in range(b)]
        held = SamplingParams(max_tokens=args.max_tokens, temperature=0, structure=schema)
        outs = engine.generate(prompts, held)
        for _, text, reason in outs:
            if reason == "stop" and args.spec == "json":
                json.loads(text)  # a stopped answer is whole JSON, or the engine is wrong
        free = [replace(held, structure=None, ignore_eos=True, max_tokens=len(ids)) for ids, _, _ in outs]
        tokens = sum(len(ids) for ids, _, _ in outs)
        times: dict[str, list[float]] = {"held": [], "free": []}
        for rep in range(args.repeats + 1):
            for kind, params in (("held", held), ("free", free)):
                t0 = time.perf_counter()
                got = engine.generate(prompts, params)
                ms = (time.perf_counter() - t0) * 1e3
                if sum(len(ids) for ids, _, _ in got) != tokens:
                    raise RuntimeError(f"{kind} generated {sum(len(i) for i, _, _ in got)} tokens, not {tokens}")
                if rep:
                    times[kind].append(ms)
        h, f = statistics.median(times["held"]), statistics.median(times["free"])
        print(f"| {b} | {tokens} | {h:,.1f} | {f:,.1f} | {h / f:.3f}x | {h / tokens:.2f} / {f / tokens:.2f} |")
    return 0
