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
