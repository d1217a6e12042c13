"""Host threads beside the engine's device (backend/device.py; device names are checked
through the engine in test_errors.py)."""

from __future__ import annotations

import torch

from tokendance.backend import device
from tokendance.backend.device import host_threads, host_tier_bytes, sync


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


def test_host_tier_default(monkeypatch):
    assert host_tier_bytes(torch.device("cpu")) == 1 << 30
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (128 << 30) // 4096}  # a 128 GiB host
    monkeypatch.setattr(device.os, "sysconf", pages.__getitem__)
    assert host_tier_bytes(torch.device("cuda")) == 8 << 30
    pages["SC_PHYS_PAGES"] = (16 << 30) // 4096  # a small host: an eighth of it
    assert host_tier_bytes(torch.device("cuda", 1)) == 2 << 30
    assert host_tier_bytes(torch.device("cuda", 1), engines=4) == 512 << 20  # the eighth, shared


def test_the_engine_takes_the_default_unless_given(tiny_llama):
    from tokendance.backend.engine import Engine

    assert Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024).idle.tier.budget == 1 << 30
    assert Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024, offload_bytes=0).idle.tier.budget == 0
