"""`tokendance serve`: the proxy, with the engine in its process or, with --engine URL,
an engine started elsewhere by `tokendance engine` (several: --engine once for each, each
session pinned to one; or, with --vllm URL, a vLLM server)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from tokendance.backend import config_file, heap, logs
from tokendance.backend.api import MODES, BackendError
from tokendance.backend.auth import ENGINE_KEY_ENV, check_keys
from tokendance.backend.flags import ENGINE_TOO, VLLM_TOO, add_engine_args, at_least, changed, engine_options
from tokendance.backend.protocol import Backend

from .core import Config
from .cors import Cors, parse
from .listen import Listen, add_args as add_listen_args, listen
from .mqtt import address
from .reasoning import PARSERS
from .server import Server
from .tools import PARSERS as TOOL_PARSERS

DEFAULT_MODE = "collective"
KEY_ENV = "TOKENDANCE_API_KEY"
VLLM_KEY_ENV = "VLLM_API_KEY"  # vLLM's, read where ours is not set


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible proxy, the engine in-process or remote (--engine)",
                              description=__doc__)
    add_listen_args(p)
    p.add_argument("--mode", choices=MODES, default=None,
                   help=f"default KV reuse mode ({DEFAULT_MODE}; prefix with --vllm)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's: taken as given (prefix finds exact prefixes, the reuse modes too "
                        "for what they compute plainly); --no-enable-prefix-caching is --mode full")
    p.add_argument("--engine", action="append", default=None, metavar="URL",
                   help="an engine started by `tokendance engine`; repeat it for several, each "
                        "session pinned to one (default: one in this process, set by the flags below)")
    p.add_argument("--vllm", action="append", default=None, metavar="URL",
                   help="a vLLM server instead of our engine: modes full and prefix only; repeat it "
                        "for several, each session pinned to one")
    p.add_argument("--engine-api-key", default=None, metavar="KEY",
                   help=f"the key the --engine or --vllm servers require (default: ${ENGINE_KEY_ENV}, else none)")
    add_engine_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=at_least(1), default=1,
                   help="engines to start, each in a process of its own on GPUs of its own "
                        "(--tensor-parallel-size each, from the first on; on the CPU, a share of its "
                        "cores each), each session pinned to one")
    p.add_argument("--mqtt", default=None, metavar="URL", help="control plane broker, mqtt://host:port")
    p.add_argument("--mqtt-peers", action="store_true",
                   help="share rounds with the other proxies on the broker: the agents that came to "
                        "each, and the answers' text (so one simulation may go through several)")
    p.add_argument("--barrier-timeout-ms", type=float, default=250.0,
                   help="longest hold at a round barrier, from the group's first arrival")
    p.add_argument("--max-group", type=int, default=256, help="requests per group at most")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish on shutdown")
    p.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                   help="read a chat answer's thinking (<think>...</think>) into its message's reasoning")
    p.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                   help="read the calls in chat answers in this format, whatever the chat template asks "
                        "for (default: the template's, Hermes or Llama 3's JSON; Hermes for one that "
                        "renders no tools, the proxy writing them in)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's: tool_choice auto is always on here; taken so vLLM's command lines run")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens per streamed chunk of chat and completion answers, the first and last "
                        "aside (a request's stream_interval may raise it)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name(s) in the API: requests may give any, answers and "
                        "/v1/models the first (default: the model's own)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help=f"answer /v1 routes only with this key (Authorization: Bearer); repeat it for "
                        f"several (default: ${KEY_ENV}, else vLLM's ${VLLM_KEY_ENV}, else none)")
    p.add_argument("--allowed-origins", default='["*"]', metavar="JSON",
                   help="CORS: the origins whose pages in a browser may call the API, a JSON list ('[]': none)")
    p.add_argument("--allowed-methods", default='["*"]', metavar="JSON", help="CORS: the methods they may use")
    p.add_argument("--allowed-headers", default='["*"]', metavar="JSON", help="CORS: the headers they may send")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: they may send cookies and authorization (the origin is echoed, never *)")
    p.add_argument("--chat-template", default=None, metavar="PATH",
                   help="a Jinja chat template file (or the template itself) to render chats with, "
                        "instead of the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="take a request's own chat_template (chats, /tokenize, chat embeddings); "
                        "without it one is a 400, as in vLLM")
    p.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of a chat's answer where the request adds the generation prompt (its "
                        "default); without it, the last message's role, as in vLLM")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name their tokens \"token_id:N\" unless a request says otherwise")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="end every streamed answer with its usage, as stream_options.include_usage asks")
    p.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request: its prompt and the sampling parameters it sets")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="vLLM's older name of --no-enable-log-requests (the default)")
    p.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="a logged prompt's characters (or token ids) at most (default: all)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line (throughput, running and waiting requests, KV pool usage) "
                        "every 10 s while the server is busy")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--uvicorn-log-level", default="info", choices=logs.HTTP_LEVELS,
                   help="the HTTP server's own log (vLLM's; its errors and faults, from this level on)")
    config_file.add_arg(p)
    p.set_defaults(func=main)
    return p


def load_backend(args: argparse.Namespace) -> Backend:
    # Imported here: torch and the model load only when a server is really started.
    key = engine_key(args)  # a bad key fails before the model loads
    if args.engine is not None:
        return remote(args.engine, args.mode, key, args.trust_remote_code)
    if args.vllm is not None:
        from tokendance.backend.vllm import VLLMBackend

        generation = (args.generation_config, args.override_generation_config)
        return asyncio.run(_connect(args.vllm, lambda u: VLLMBackend.connect(
            u, args.tokenizer, args.mode or "prefix", api_key=key, generation=generation,
            trust_remote_code=args.trust_remote_code, revision=args.tokenizer_revision or args.revision,
            download_dir=args.download_dir)))
    from tokendance.backend.service import EngineBackend

    return EngineBackend.load(mode=args.mode or DEFAULT_MODE, **engine_options(args))


def remote(urls: list[str], mode: str | None, key: str | None, trust_remote_code: bool = False) -> Backend:
    """Our engines at `urls` (ValueError if one cannot answer)."""
    from tokendance.backend.remote import RemoteBackend

    return asyncio.run(_connect(urls, lambda u: RemoteBackend.connect(u, mode or DEFAULT_MODE, api_key=key,
                                                                      trust_remote_code=trust_remote_code)))


async def _connect(urls: list[str], connect: Callable[[str], Awaitable[Backend]]) -> Backend:
    """One backend, or a fleet of them (each session pinned to one); ValueError, a line
    for the user, if one cannot answer."""
    from tokendance.backend.fleet import Fleet

    try:
        return await (connect(urls[0]) if len(urls) == 1 else Fleet.connect(urls, connect))
    except BackendError as e:
        raise ValueError(str(e)) from e


def engine_key(args: argparse.Namespace) -> str | None:
    """The key sent to the --engine or --vllm servers: the flag's, else $TOKENDANCE_ENGINE_API_KEY's."""
    remote = args.engine is not None or args.vllm is not None
    if args.engine_api_key is not None:
        if not remote:
            raise ValueError("--engine-api-key is sent to the --engine or --vllm servers: give one")
        return check_keys([args.engine_api_key], "--engine-api-key")[0]
    env = os.environ.get(ENGINE_KEY_ENV)
    return check_keys([env], "$" + ENGINE_KEY_ENV)[0] if env and remote else None


def reuse_mode(mode: str | None, prefix_caching: bool | None) -> str | None:
    """--mode with vLLM's --[no-]enable-prefix-caching (None: the backend's default mode)."""
    if prefix_caching is None:
        return mode
    if prefix_caching and mode == "full":
        raise ValueError("--mode full reuses no KV: not with --enable-prefix-caching")
    if not prefix_caching and mode not in (None, "full"):
        raise ValueError(f"--no-enable-prefix-caching reuses no KV: not with --mode {mode}")
    return mode if prefix_caching else "full"


def config(args: argparse.Namespace) -> Config:
    env = os.environ.get(KEY_ENV) or os.environ.get(VLLM_KEY_ENV)
    keys = check_keys(args.api_key or ([env] if env else []), "--api-key")
    names = tuple(args.served_model_name or ())
    if any(not n.strip() for n in names) or len(set(names)) != len(names):
        raise ValueError("--served-model-name: give each name once, none empty")
    if args.mqtt_peers and not args.mqtt:
        raise ValueError("--mqtt-peers shares rounds over the MQTT broker: give --mqtt too")
    if not args.response_role.strip():
        raise ValueError("--response-role must name a role")
    if args.stream_interval < 1:
        raise ValueError(f"--stream-interval must be at least 1, not {args.stream_interval}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be at least 0, not {args.max_log_len}")
    policy = Cors(*(parse(f"--allowed-{what}", getattr(args, f"allowed_{what}"))
                    for what in ("origins", "methods", "headers")), credentials=args.allow_credentials)
    return Config(barrier_timeout=args.barrier_timeout_ms / 1e3, max_group=args.max_group,
                  drain_timeout=args.drain_timeout, reasoning=args.reasoning_parser,
                  tool_parser=args.tool_call_parser, names=names,
                  api_keys=frozenset(keys), peers=args.mqtt_peers, stream_interval=args.stream_interval,
                  cors=policy, trust_chat_template=args.trust_request_chat_template, response_role=args.response_role,
                  as_ids=args.return_tokens_as_token_ids, force_usage=args.enable_force_include_usage,
                  log_requests=args.enable_log_requests,
                  max_log_len=args.max_log_len, log_stats=not args.disable_log_stats)


def chat_template(backend: Backend, given: str) -> None:
    """Render chats with `given` (a file, or the template itself) instead of the tokenizer's
    own; a template that cannot render a plain chat is refused here, not per request."""
    from tokendance.backend.api import InvalidRequest

    path = Path(given).expanduser()
    if path.is_file():
        text = path.read_text()
    elif "{{" in given or "{%" in given:
        text = given
    else:
        raise ValueError(f"--chat-template: no such file: {given}")
    tokenizer = getattr(backend, "tokenizer", None)
    if tokenizer is None:
        raise ValueError(f"--chat-template: the {backend.info.name} backend renders no chats")
    tokenizer.chat_template = text
    try:
        backend.render_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    except InvalidRequest as e:
        raise ValueError(f"--chat-template cannot render a chat: {e.message}") from None


async def serve(server: Server, where: Listen, stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set), then drain and close."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start(where)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await server.stop()


def main(args: argparse.Namespace) -> int:
    logs.to_stderr(args.log_level)
    logs.http(args.uvicorn_log_level)
    args.mode = reuse_mode(args.mode, args.enable_prefix_caching)
    if args.max_group < 1:
        raise ValueError("--max-group must be at least 1")
    if not args.barrier_timeout_ms >= 0:  # `not >=`: NaN fails too
        raise ValueError("--barrier-timeout-ms must be a number, not negative")
    if args.engine is not None and args.vllm is not None:
        raise ValueError("--engine and --vllm name two backends: give one")
    if args.data_parallel_size > 1 and (args.engine is not None or args.vllm is not None):
        raise ValueError("--data-parallel-size starts engines here: not with --engine or --vllm")
    for flag, given in (("--engine", args.engine), ("--vllm", args.vllm)):
        urls = [u.rstrip("/") for u in given or ()]
        twice = next((u for u in urls if urls.count(u) > 1), None)
        if twice is not None:
            raise ValueError(f"{flag} {twice} is given twice: name each server once")
    given = changed(args)
    flags = ", ".join(f for f in given if f not in ENGINE_TOO)
    if args.engine is not None and flags:
        raise ValueError(f"{flags} set the engine: with --engine, give them to `tokendance engine`")
    own = ", ".join(f for f in given if f not in VLLM_TOO)
    if args.vllm is not None and own:
        raise ValueError(f"{own} set our engine: a vLLM server has its own")
    if args.vllm is not None and args.mode not in (None, "full", "prefix"):
        raise ValueError(f"--mode {args.mode} needs the TokenDance engine; a vLLM server serves full and prefix")
    if args.engine is None and args.vllm is None:
        engine_options(args)  # a bad value fails before the model loads
    if not args.drain_timeout >= 0:
        raise ValueError("--drain-timeout must be a number, not negative")
    where = listen(args)
    if args.mqtt:
        address(args.mqtt)  # a bad URL fails before the model loads
    cfg = config(args)  # a bad flag fails before the model loads
    replicas = None
    if args.data_parallel_size > 1:
        from tokendance.backend import replicas as data_parallel

        replicas = data_parallel.start(engine_options(args), args.data_parallel_size)
    try:
        backend = load_backend(args) if replicas is None else remote(replicas.urls, args.mode, replicas.key,
                                                                     args.trust_remote_code)
        if args.chat_template is not None:
            chat_template(backend, args.chat_template)
        server = Server(backend, cfg, args.mqtt)
        if cfg.tool_parser is not None:  # one the chat template cannot take fails now, not per request
            server.proxy.dialect()
        with heap.frozen():
            asyncio.run(serve(server, where))
    finally:
        if replicas is not None:
            replicas.stop()
    return 0
