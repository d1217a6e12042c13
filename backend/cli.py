"""`tokendance generate`: one prompt through the engine, no server."""

from __future__ import annotations

import argparse
import sys
import time

from tokendance.backend.api import SamplingParams
from tokendance.backend.flags import add_source_args, source_options
from tokendance.backend.prompt import render_chat


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="run the engine on one prompt")
    p.add_argument("prompt", help="the user message (or raw text with --raw); - reads stdin")
    p.add_argument("--model", default=None, help="HF folder, .gguf or a hub id in the Hugging Face cache "
                                                 "(default: embedded SmolLM2-135M-Instruct)")
    add_source_args(p)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text as given")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0, help="0 to 1, of the likeliest token's probability")
    p.add_argument("--min-tokens", type=int, default=0, help="no end before this many tokens")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2, over generated tokens")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2, over generated tokens")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, over prompt and generated tokens")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--stats", action="store_true", help="print token counts and speed to stderr")


def main(args: argparse.Namespace) -> int:
    from tokendance.backend.engine import Engine

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    for what, value in (("the prompt", text), ("--system", args.system or "")):
        if not _utf8(value):  # the tokenizer's TypeError would be a traceback
            raise ValueError(f"{what} is not UTF-8 text")
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, min_tokens=args.min_tokens,
                              seed=args.seed, stop=args.stop,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              repetition_penalty=args.repetition_penalty)
    sampling.validate()
    eng = Engine(**source_options(args), dtype=args.dtype, device=args.device)
    if args.raw:
        prompt = eng.tokenizer.encode(text)
    else:
        msgs = [{"role": "system", "content": args.system}] if args.system else []
        msgs.append({"role": "user", "content": text})
        prompt = eng.encode(render_chat(eng.tokenizer, msgs))
    eng.add("cli", prompt, sampling)
    start, first, n = time.perf_counter(), None, 0
    while eng.has_work():
        for _, delta in eng.step():
            first = first or time.perf_counter()
            n += len(delta.token_ids)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats and first is not None:
        end = time.perf_counter()
        rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(f"prompt {len(prompt)} tokens, {n} generated; first token {1000 * (first - start):.0f} ms, "
              f"{rate:.1f} tokens/s after", file=sys.stderr)
    return 0


def _utf8(text: str) -> bool:
    """False for text with bytes that were not UTF-8 (argv and stdin keep them as surrogates)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
