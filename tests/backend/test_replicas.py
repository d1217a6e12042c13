"""Data parallelism's engines: which devices each takes."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import replicas
from tokendance.backend.api import InvalidRequest


def test_on_the_cpu_every_engine_shares_it():
    assert replicas.devices({"device": "cpu"}, 3) == ["cpu"] * 3


def test_each_engine_takes_its_tensor_parallel_gpus_in_turn(monkeypatch):
    monkeypatch.setattr(replicas, "pick_device", lambda name: torch.device(name if name != "auto" else "cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert replicas.devices({}, 4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert replicas.devices({"tensor_parallel_size": 2}, 2) == ["cuda:0", "cuda:2"]
    assert replicas.devices({"device": "cuda:1", "tensor_parallel_size": 1}, 3) == ["cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(InvalidRequest, match="--data-parallel-size 2 x --tensor-parallel-size 2 from cuda:1 "
                                             "needs 5 GPUs; there are 4"):
        replicas.devices({"device": "cuda:1", "tensor_parallel_size": 2}, 2)


def test_engines_share_the_host_tiers_default_unless_it_is_given(monkeypatch):
    monkeypatch.setattr(replicas, "pick_device", lambda name: torch.device(name if name != "auto" else "cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(replicas, "host_tier_bytes", lambda dev, engines: (64 << 30) // 8 // engines)
    out = replicas.each({"offload_bytes": None, "seed": 3}, 4)
    assert [o["device"] for o in out] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [o["offload_bytes"] for o in out] == [2 << 30] * 4 and all(o["seed"] == 3 for o in out)
    assert {o["offload_bytes"] for o in replicas.each({"offload_bytes": 0}, 2)} == {0}
    assert {o["offload_bytes"] for o in replicas.each({"offload_bytes": 5 << 30}, 2)} == {5 << 30}
