"""The engine's device, and what the host process does beside it."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from tokendance.backend.api import InvalidRequest


def pick_device(name: str) -> torch.device:
    """The engine's device: "auto" (CUDA when there is one), "cpu", "cuda" or "cuda:N";
    InvalidRequest for anything else or a GPU this machine lacks."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"unsupported device {name!r}; choose auto, cpu, cuda or cuda:N", "device")
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index or 0) >= torch.cuda.device_count()):
        raise InvalidRequest(f"device {name!r} is not available here "
                             f"({torch.cuda.device_count()} CUDA devices)", "device")
    return dev


def host_threads(device: torch.device, env: Mapping[str, str]) -> int | None:
    """torch's CPU threads for an engine on `device`, or None to leave them as they are.
    On CUDA the host only builds small tensors and launches kernels, which intra-op
    threads do not speed up; on the H200 machine's 16-core host, with torch's default of
    16, single small ops (a 3.5 k-element index) stalled ~6 ms at times, and a round of
    resumed agents took 199 ms against 174 with one thread. So one, as vLLM sets
    OMP_NUM_THREADS by default, unless OMP_NUM_THREADS chooses."""
    if device.type != "cuda" or "OMP_NUM_THREADS" in env:
        return None
    return 1


def host_tier_bytes(device: torch.device, engines: int = 1) -> int:
    """The host tier's default size (idle agents' KV between their rounds, backend/idle.py)
    for one of `engines` engines on this host. Beside a GPU, 8 GiB, or an eighth of the
    host's memory shared between the engines if that is less: on the H200, a 7B-shaped
    model's 20 agents did not all fit in 1 GiB, and their resumed round took 749 ms
    against 576 with room for all (docs/benchmarks.md, resuming idle agents). On a CPU,
    whose KV pool is host memory already, 1 GiB."""
    if device.type != "cuda":
        return 1 << 30
    return min(8 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8 // engines)


def sync(device: torch.device) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU): what a
    wall-clock timing of GPU work brackets."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
