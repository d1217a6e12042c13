"""`tokendance serve`: the proxy with the embedded engine, in one process."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal

from tokendance.backend import logs
from tokendance.backend.api import BASES, MODES, REUSE_DEFAULTS, Backend

from .app import Server
from .core import Config
from .mqtt import address

DEFAULT_MODE = "collective"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible server with the embedded engine",
                              description=__doc__)
    p.add_argument("--model", default=None, help="HF folder or GGUF file (default: embedded SmolLM2)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE, help="default KV reuse mode")
    add_reuse_args(p)
    p.add_argument("--offload-gib", type=float, default=1.0,
                   help="host memory for idle agents' KV between their rounds (0: off)")
    p.add_argument("--mqtt", default=None, metavar="URL", help="control plane broker, mqtt://host:port")
    p.add_argument("--barrier-timeout-ms", type=float, default=250.0,
                   help="longest hold at a round barrier, from the group's first arrival")
    p.add_argument("--max-group", type=int, default=256, help="requests per group at most")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish on shutdown")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=main)
    return p


def add_reuse_args(p: argparse.ArgumentParser) -> None:
    """The engine's reuse policy (`serve`, and `simulate`'s in-process engine)."""
    p.add_argument("--recompute-ratio", type=float, default=REUSE_DEFAULTS["recompute_ratio"],
                   help="pic / collective: share of each request's reused tokens recomputed, at most")
    p.add_argument("--recompute-floor", type=float, default=REUSE_DEFAULTS["recompute_floor"],
                   help="pic / collective: of those, only tokens whose KV deviation at the check "
                        "layer exceeds this (0: all of them; docs/fidelity.md)")
    p.add_argument("--bases", choices=BASES, default=REUSE_DEFAULTS["bases"],
                   help="pic / collective: a shared segment's base KV prefilled standalone once per "
                        "round; its producer's own KV of it (no prefill; lower fidelity on SmolLM2); "
                        "or its KV in a reader's context (two requests of a round prefilled in full; "
                        "closer to exact prefill; with --recompute-ratio 0.3 half of SmolLM2's "
                        "debates stay identical to it at 4 and 8 agents; docs/fidelity.md)")


def reuse_options(args: argparse.Namespace) -> dict[str, float | str]:
    """The engine config's reuse fields, from `add_reuse_args`' flags."""
    return {name: getattr(args, name) for name in REUSE_DEFAULTS}


def load_backend(args: argparse.Namespace) -> Backend:
    # Imported here: torch and the model load only when a server is really started.
    from tokendance.backend.service import EngineBackend

    return EngineBackend.load(args.model, dtype=args.dtype, mode=args.mode,
                              offload_bytes=int(args.offload_gib * 2**30), **reuse_options(args))


def config(args: argparse.Namespace) -> Config:
    return Config(barrier_timeout=args.barrier_timeout_ms / 1e3, max_group=args.max_group,
                  drain_timeout=args.drain_timeout)


async def serve(server: Server, host: str, port: int, stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set), then drain and close."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start(host, port)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop()


def main(args: argparse.Namespace) -> int:
    logs.to_stderr(args.log_level)
    if args.max_group < 1:
        raise ValueError("--max-group must be at least 1")
    if not args.barrier_timeout_ms >= 0:  # `not >=`: NaN fails too
        raise ValueError("--barrier-timeout-ms must be a number, not negative")
    if not 0 <= args.offload_gib < math.inf:
        raise ValueError("--offload-gib must be a finite number, not negative")
    if not args.drain_timeout >= 0:
        raise ValueError("--drain-timeout must be a number, not negative")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must lie in 0..65535, got {args.port}")
    if args.mqtt:
        address(args.mqtt)  # a bad URL fails before the model loads
    server = Server(load_backend(args), config(args), args.mqtt)
    asyncio.run(serve(server, args.host, args.port))
    return 0
