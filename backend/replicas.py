"""Data parallelism: `serve --data-parallel-size N` runs N engines, each a process of its
own on devices of its own, behind the proxy as a fleet (backend/fleet.py: each session
pinned to one engine, where its rounds' Masters and its parked agents live).

Engine i takes the tensor_parallel_size devices from the engine's device + i * that on
(two engines of -tp 2 on four GPUs: 0-1 and 2-3); on the CPU each takes its share of the
cores. They serve the engine API (backend/endpoint.py) on loopback, at ports of their
choosing, to a key made here, and exit with the process that started them. Unless
--offload-gib says, they share the host tier's default between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import secrets
import signal
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.multiprocessing as mp

from tokendance.backend.api import InvalidRequest
from tokendance.backend.device import host_tier_bytes, pick_device
from tokendance.backend.parallel import subordinate


@dataclass
class Replicas:
    procs: list[BaseProcess]
    urls: list[str]
    key: str  # what the proxy sends them

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM each (it drains, then closes its engine), then wait for them."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()


def devices(options: dict[str, Any], size: int) -> list[str]:
    """Each engine's device option (InvalidRequest if the GPUs are too few)."""
    dev = pick_device(options.get("device", "auto"))
    if dev.type != "cuda":
        return [str(dev)] * size
    tp = options.get("tensor_parallel_size", 1)
    first, have = dev.index or 0, torch.cuda.device_count()
    if first + size * tp > have:
        raise InvalidRequest(f"--data-parallel-size {size} x --tensor-parallel-size {tp} from {dev} needs "
                             f"{first + size * tp} GPUs; there are {have}", "data_parallel_size")
    return [f"cuda:{first + i * tp}" for i in range(size)]


def each(options: dict[str, Any], size: int) -> list[dict[str, Any]]:
    """Each engine's EngineConfig options: its device, and its share of the host tier's
    default (the host's memory is one, however many engines use it)."""
    out = [dict(options, device=d) for d in devices(options, size)]
    if options.get("offload_bytes") is None:
        share = host_tier_bytes(pick_device(out[0]["device"]), engines=size)
        out = [dict(o, offload_bytes=share) for o in out]
    return out


def start(options: dict[str, Any], size: int) -> Replicas:
    """Start `size` engines of EngineConfig `options`; return once each serves
    (ChildProcessError, the others stopped, if one cannot)."""
    key = secrets.token_urlsafe(24)
    ctx = mp.get_context("spawn")
    ready: Any = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // size)
    procs = [ctx.Process(target=_engine, args=(o, key, i, ready, threads), name=f"tokendance-dp{i}")
             for i, o in enumerate(each(options, size))]
    for p in procs:
        p.start()
    out = Replicas(procs, [""] * size, key)
    try:
        for _ in procs:
            i, port, error = _next(ready, procs)
            if error:
                raise ChildProcessError(f"data-parallel engine {i}: {error}")
            out.urls[i] = f"http://127.0.0.1:{port}"
    except BaseException:
        out.stop(timeout=5)
        raise
    return out


def _next(ready: Any, procs: list[BaseProcess]) -> tuple[int, int, str]:
    """The next engine's report, failing as soon as one has exited without one."""
    while True:
        with contextlib.suppress(queue.Empty):
            return ready.get(timeout=0.2)
        gone = next((p for p in procs if not p.is_alive()), None)
        if gone is not None:
            with contextlib.suppress(queue.Empty):
                return ready.get(timeout=1.0)  # its last word, if it left one
            raise ChildProcessError(f"data-parallel engine {gone.name} exited (code {gone.exitcode}) "
                                    "before it served; its output says why")


def _engine(options: dict[str, Any], key: str, index: int, ready: Any, threads: int) -> None:
    """An engine process: load, serve on loopback, report the port (or why not)."""
    subordinate()  # a terminal's ^C: the proxy drains, then stops us
    from tokendance.backend.auth import Keys
    from tokendance.backend.endpoint import Endpoint, engine_info, serve
    from tokendance.backend.service import EngineBackend

    if options.get("device", "cpu").startswith("cpu") and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(threads)
    try:
        backend = EngineBackend.load(**options)
    except (ValueError, OSError, RuntimeError) as e:  # a bad model or flag, a device it cannot have
        ready.put((index, 0, str(e)))
        raise SystemExit(1) from None
    endpoint = Endpoint(backend, engine_info(backend), Keys([key]))

    async def run() -> None:
        started = asyncio.get_running_loop().create_future()
        started.add_done_callback(lambda f: ready.put((index, f.result(), "")))
        await serve(endpoint, "127.0.0.1", 0, started=started, signals=(signal.SIGTERM,))

    asyncio.run(run())
