"""`tokendance simulate {debate,town,society}`: run a simulation through the proxy and
print what each round shared, reused and held. `--compare` runs the same seed in
`full` (no reuse, exact) too and says where the outputs first diverged."""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
from collections.abc import Callable

from tqdm import tqdm

from tokendance.adapters.retry import RETRIES
from tokendance.backend import logs
from tokendance.backend.api import KV_DTYPES, MODES, REUSE_DEFAULTS
from tokendance.backend.flags import add_parallel_args, add_reuse_args, json_object, reuse_options
from tokendance.examples.client import Client
from tokendance.examples.loop import Round, run
from tokendance.examples.scenario import Scenario
from tokendance.examples.table import diverged, render

LEGEND = ("reused %: prompt tokens whose KV was reused, not computed; KV held/dense: KV the "
          "round holds (each request's\nown, the blocks they share once) vs a dense cache per "
          "request; latency: first request sent to last reply read.")


def scenarios() -> dict[str, Callable[[int, int], Scenario]]:
    from tokendance.examples.debate import Debate
    from tokendance.examples.society import Society
    from tokendance.examples.town import Town

    return {"debate": Debate, "town": Town, "society": Society}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("simulate", help="run a multi-agent simulation, print per-round stats",
                              description=__doc__)
    p.add_argument("scenario", choices=("debate", "town", "society"))
    p.add_argument("--agents", type=int, default=4, help="agents (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--mode", choices=MODES, default=None,
                   help="KV reuse mode (default: the best the server offers)")
    p.add_argument("--url", default=None, help="a running proxy (default: start one in-process)")
    p.add_argument("--model", default=None,
                   help="in-process engine: HF folder or GGUF file (default: embedded SmolLM2); "
                   "'echo' runs without a model")
    p.add_argument("--compare", action="store_true", help="also run in `full` and diff the outputs")
    add_reuse_args(p)  # the in-process engine's; a running proxy (--url) has its own
    p.add_argument("--kv-cache-dtype", choices=KV_DTYPES, default="auto",
                   help="the in-process engine's KV pool: auto (the model's dtype) or 8-bit floats")
    add_parallel_args(p)
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='the in-process engine\'s n-gram speculation, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=48, help="per reply (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy, comparable")
    p.add_argument("--api", choices=("chat", "responses", "conversations", "messages", "batch"), default="chat",
                   help="chat completions, the Responses API (each agent continues its stored "
                   "conversation by previous_response_id, or in a conversation object), "
                   "Anthropic's Messages API, or each round as one batch of chats")
    p.add_argument("--repetition-detection", type=loops, default=None, metavar="SIZE[,COUNT]",
                   help="end a reply once it ends in a pattern of 1 to SIZE tokens repeated COUNT "
                   "times (default 3), as vLLM's repetition_detection does (chat and batch APIs)")
    p.add_argument("--retries", type=int, default=RETRIES,
                   help="send a request the proxy answered with a 5xx or 429 (its engine unreachable, "
                   "lost or restarting) again up to this often, after the Retry-After it names or a "
                   "backoff of 0.5 s doubling to 8 s (default %(default)s, as the openai SDK's max_retries)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p


def loops(text: str) -> dict[str, int]:
    """'32' or '32,3' -> vLLM's repetition_detection."""
    parts = text.split(",")
    try:
        size, count = int(parts[0]), (int(parts[1]) if len(parts) > 1 else 3)
    except ValueError:
        size = count = 0
    if len(parts) > 2 or size < 1 or count < 2:
        raise argparse.ArgumentTypeError(f"expected SIZE[,COUNT], SIZE at least 1 and COUNT at least 2, got {text!r}")
    return {"max_pattern_size": size, "min_pattern_size": 1, "min_count": count}


def main(args: argparse.Namespace) -> int:
    if args.agents < 1 or args.rounds < 1 or args.max_tokens < 1:
        raise ValueError("--agents, --rounds and --max-tokens must be at least 1")
    if args.retries < 0:
        raise ValueError("--retries must be at least 0")
    if args.repetition_detection is not None and args.api not in ("chat", "batch"):
        raise ValueError("--repetition-detection is a chat completions parameter: use --api chat or batch")
    logs.to_stderr(args.log_level)
    from tokendance.adapters.rounds import ProxyError

    try:
        print(asyncio.run(simulate(args)))
    except ProxyError as e:  # the proxy refused a request (a 4xx names the bad argument)
        raise ValueError(str(e)) from e
    return 0


async def simulate(args: argparse.Namespace) -> str:
    """Every run the arguments ask for; the report to print."""
    if args.url is not None:
        if (reuse_options(args) != REUSE_DEFAULTS or args.tensor_parallel_size != 1 or args.kv_cache_dtype != "auto"
                or args.speculative_config is not None):
            raise ValueError("--recompute-ratio, --recompute-floor, --bases, --tensor-parallel-size, "
                             "--kv-cache-dtype and --speculative-config set the in-process engine; a running "
                             "proxy has its own (tokendance serve ...)")
        return await report(args, args.url, args.mode)
    from tokendance.examples import local

    be = local.backend(args.model, args.mode, **reuse_options(args), tensor_parallel_size=args.tensor_parallel_size,
                       kv_cache_dtype=args.kv_cache_dtype, speculative_config=args.speculative_config)
    async with local.proxy(be) as url:
        return await report(args, url, args.mode or getattr(be, "mode", None))


async def report(args: argparse.Namespace, url: str, mode: str | None) -> str:
    modes = (["full"] if args.compare else []) + [mode]
    total = len(modes) * args.rounds
    bar = tqdm(total=total, desc=args.scenario, unit="round", file=sys.stderr, leave=False)
    out: list[str] = []
    runs: list[list[Round]] = []
    try:
        for m in modes:
            scenario = scenarios()[args.scenario](args.agents, args.seed)
            rounds = await once(args, url, scenario, m, lambda r: bar.update(1))
            runs.append(rounds)
            title = f"{args.scenario}: {args.agents} agents, mode {m or 'server default'}, seed {args.seed}"
            out += [render(rounds, title), scenario.summary()]
            if args.repetition_detection is not None:
                ended = [rep.finish for r in rounds for rep in r.replies.values()]
                out.append(f"replies ended by repetition detection: {ended.count('repetition')} of {len(ended)}")
            out.append("")
    finally:
        bar.close()
    if args.compare:
        out += [diverged(runs[0], runs[1]), ""]
    out.append(LEGEND)
    return "\n".join(out)


async def once(args: argparse.Namespace, url: str, scenario: Scenario, mode: str | None,
               on_round: Callable[[Round], None]) -> list[Round]:
    from tokendance.adapters.rounds import served_model

    try:
        model = await asyncio.to_thread(served_model, url)
    except OSError as e:
        raise ConnectionError(f"no proxy answers at {url} ({getattr(e, 'reason', e)})") from e
    session = f"{scenario.name}-{mode or 'default'}-{args.seed}-{secrets.token_hex(3)}"
    async with Client(url, session, mode, model, args.max_tokens, args.temperature, args.seed,
                      api=args.api, repetition=args.repetition_detection, retries=args.retries) as c:
        return await run(scenario, c, args.rounds, on_round)


def entry(name: str) -> int:
    """`python -m tokendance.examples.<name> [options]` = `tokendance simulate <name> ...`."""
    from tokendance.examples.cli import main as cli

    return cli(["simulate", name, *sys.argv[1:]])
