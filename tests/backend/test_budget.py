"""The KV pool's size (backend/budget.py): as given, the CPU's default, and vLLM's
--gpu-memory-utilization worked out from the GPU's memory (its measurements stood in for
here; bench/check_cuda.py runs it on a GPU)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import budget
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine

GiB = 2**30
CUDA = torch.device("cuda")


class FakeGPU:
    """mem_get_info as a GPU of `total` bytes answers: free0 at start, `held` taken since."""

    def __init__(self, monkeypatch, total: int, free0: int, held: int, peak: int, graphs: int = 0):
        self.free0, self.total, self.held = free0, total, held
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free0 - self.held, self.total))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(budget, "step_peak", lambda model, tokens, device, top: peak)
        monkeypatch.setattr(budget, "graphs_reserve", lambda cfg, model, device: graphs)
        monkeypatch.setattr(budget, "ahead", lambda model, step: 0)


def test_the_share_counts_the_weights_a_steps_peak_and_the_graphs(monkeypatch):
    gpu = FakeGPU(monkeypatch, total=140 * GiB, free0=139 * GiB, held=15 * GiB, peak=3 * GiB, graphs=GiB // 2)
    per_token = 57344  # Qwen2.5-7B's K/V a token, bf16
    cfg = EngineConfig(gpu_memory_utilization=0.5)
    assert budget.pool_tokens(cfg, None, CUDA, per_token, 16384, gpu.free0) == int(51.5 * GiB) // per_token
    # without a share, 85 % of what the weights leave free
    assert budget.pool_tokens(EngineConfig(), None, CUDA, per_token, 16384, gpu.free0) == \
        int(124 * GiB * 0.85) // per_token
    assert budget.pool_tokens(EngineConfig(kv_tokens=4096), None, CUDA, per_token, 16384, gpu.free0) == 4096


def test_a_share_that_cannot_be_had_is_refused(monkeypatch):
    gpu = FakeGPU(monkeypatch, total=140 * GiB, free0=60 * GiB, held=15 * GiB, peak=3 * GiB)
    with pytest.raises(ValueError, match="asks for 70.0 GiB of the GPU's 140.0; 60.0 GiB were free"):
        budget.pool_tokens(EngineConfig(gpu_memory_utilization=0.5), None, CUDA, 57344, 16384, gpu.free0)
    with pytest.raises(ValueError, match="leaves no room for the KV pool: the weights hold 15.0 GiB"):
        budget.pool_tokens(EngineConfig(gpu_memory_utilization=0.12), None, CUDA, 57344, 16384, gpu.free0)


def test_on_the_cpu_a_share_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="needs a GPU"):
        Engine(model=str(tiny_llama), dtype="float32", device="cpu", gpu_memory_utilization=0.5)
    assert budget.pool_tokens(EngineConfig(), None, torch.device("cpu"), 100, 2048, 0) == budget.CPU_TOKENS

