"""The engine on its own thread, driven from asyncio: submit, stream, abort.

The model runs on a worker thread (torch releases the GIL while it computes), so the
event loop that serves HTTP stays responsive. Commands go in through a thread-safe
queue; deltas come back to each request's asyncio queue via call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from tokendance.backend.api import BackendError, Delta, InvalidRequest, Pooling, SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.stream import QueueStream

log = structlog.get_logger(__name__)


def _STOP() -> None:
    """Sentinel command: leave the worker loop."""


@dataclass(slots=True)
class Job:
    rid: str
    prompt: list[int]
    sampling: SamplingParams
    mode: str = "full"
    shared: list[tuple[int, int]] | None = None
    tenant: str = ""
    publish: bool = False
    agent: str | None = None  # session/agent: its next request may resume from this one
    pool: Pooling | None = None  # an embedding request (backend/pooling.py)


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.streams: dict[str, QueueStream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._work, name="tokendance-engine", daemon=True)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    def submit(self, jobs: list[Job]) -> list[QueueStream]:
        """Queue jobs to start in the same step; a job the engine rejects gets its
        error on its stream."""
        if self.loop is None:
            self.start()
        if not self.thread.is_alive():
            raise BackendError("the engine has been shut down")
        streams = [QueueStream(j.rid, self) for j in jobs]
        for s in streams:
            self.streams[s.rid] = s

        def add() -> None:
            for j in jobs:
                try:
                    self.engine.add(j.rid, j.prompt, j.sampling, j.mode, j.shared, j.tenant, j.publish,
                                    j.agent, j.pool)
                except InvalidRequest as e:
                    self._deliver(j.rid, e)
                except Exception as e:  # fails this job only: the thread serves everyone else
                    log.exception("engine add failed", rid=j.rid)
                    self.engine.abort(j.rid)
                    self._deliver(j.rid, BackendError(f"{type(e).__name__}: {e}"))

        self.inbox.put(add)
        return streams

    def abort(self, rid: str) -> None:
        self.streams.pop(rid, None)
        self.inbox.put(lambda: self.engine.abort(rid))

    async def close(self) -> None:
        if self.thread.is_alive():
            self.inbox.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join)
        self.engine.close()  # its tensor-parallel followers, once no step runs

    # -- worker thread ---------------------------------------------------------------

    def _deliver(self, rid: str, item: Delta | BaseException) -> None:
        stream = self.streams.get(rid)
        if stream is None:
            return
        if isinstance(item, BaseException) or item.finish_reason:
            self.streams.pop(rid, None)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(stream.put, item)

    def _work(self) -> None:
        eng = self.engine
        while True:
            if eng.has_work():
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            else:
                cmd = self.inbox.get()
            if cmd is _STOP:
                err = BackendError("the engine has been shut down")
                for rid in list(eng.seqs):
                    eng.abort(rid)
                    self._deliver(rid, err)
                return
            if cmd is not None:
                cmd()
                continue  # drain every queued command before the next step
            running = list(eng.seqs)
            try:
                for rid, delta in eng.step():
                    self._deliver(rid, delta)
            except Exception as e:  # the step failed: every request in flight gets the error,
                log.exception("engine step failed")  # those it ended too (their last delta is lost)
                err = BackendError(f"{type(e).__name__}: {e}")
                for rid in dict.fromkeys(running + list(eng.seqs)):
                    eng.abort(rid)
                    self._deliver(rid, err)
