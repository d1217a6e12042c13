"""Host threads beside the engine's device (backend/device.py; device names are checked
through the engine in test_errors.py)."""

from __future__ import annotations

import torch

from tokendance.backend.device import host_threads, sync


def test_one_host_thread_beside_a_gpu_unless_chosen():
    assert host_threads(torch.device("cuda"), {}) == 1
    assert host_threads(torch.device("cuda", 1), {"PATH": "/bin"}) == 1
    assert host_threads(torch.device("cuda"), {"OMP_NUM_THREADS": "8"}) is None
    assert host_threads(torch.device("cpu"), {}) is None  # the CPU engine computes with them


def test_sync_waits_on_cuda_only(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    sync(torch.device("cpu"))
    assert waited == []
    sync(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]
