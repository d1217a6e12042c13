"""Where the command line's logs go: stderr, from a level on, so that stdout carries
answers and reports only (`tokendance generate > out.txt` holds the answer alone)."""

from __future__ import annotations

import logging
import sys

import structlog


def to_stderr(level: str = "info") -> None:
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # sys.stderr resolved per logger, not once: whoever swaps the stream (pytest's
        # capture, a notebook) must not leave loggers writing to a closed file.
        logger_factory=lambda *_: structlog.PrintLogger(sys.stderr),
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.StackInfoRenderer(),
            structlog.dev.set_exc_info,
            structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False),
            # Python's own traceback: structlog's default (rich, with every frame's locals)
            # printed requests' prompts and whole tensors into the log, thousands of lines.
            # Colours on a terminal only, not in a file or a container's log.
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(),
                                          exception_formatter=structlog.dev.plain_traceback),
        ],
    )


HTTP_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's --uvicorn-log-level


class _Stderr(logging.StreamHandler):
    """A handler writing to sys.stderr as it is at each record (see `to_stderr`)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass


def http(level: str) -> None:
    """The HTTP server's own log (aiohttp's: a handler's unexpected error, a connection's
    fault) to stderr from `level` on; vLLM's --uvicorn-log-level sets its server's so
    (trace, uvicorn's lowest, is debug here). Answered requests are logged by the proxy."""
    log = logging.getLogger("aiohttp")
    log.setLevel(logging.DEBUG if level == "trace" else getattr(logging, level.upper()))
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s [%(levelname)s] %(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False  # not twice through the root's last-resort handler
