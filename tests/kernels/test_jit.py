"""What the Triton kernels do not take is served by the references: an install without
Triton (it is an optional extra), head dims the kernels do not tile."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tokendance.kernels.jit import HAVE_TRITON, tiles_head
from tokendance.kernels.paged_triton import paged_attention_triton

SCRIPT = r'''
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton")

sys.meta_path.insert(0, NoTriton())
from tokendance.kernels import collective, deviation, jit, norm, paged_attention, restore, rope
from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
assert not jit.HAVE_TRITON and "triton" not in sys.modules
eng = Engine(model=sys.argv[1], dtype="float32", kv_tokens=1024)
toks = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0][0]
print(" ".join(map(str, toks)))
'''


def test_engine_runs_without_triton(tiny_llama):
    from tokendance.backend.api import SamplingParams
    from tokendance.backend.engine import Engine

    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_llama)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024)
    want = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0][0]
    assert out.stdout.splitlines()[-1].split() == [str(t) for t in want]  # after the log lines


@pytest.mark.skipif(not HAVE_TRITON, reason="no triton")
def test_the_head_dims_the_triton_kernels_tile_and_what_the_rest_get():
    """The head dims the Triton kernels tile (the dispatchers give the rest to the
    references), and the Triton entry point saying why it refuses another."""
    assert [d for d in (8, 15, 16, 48, 80, 96, 100, 256, 258, 512) if tiles_head(d)] == [16, 48, 80, 96, 100, 256]
    q = torch.randn(1, 2, 8)
    kv = torch.zeros(2, 16, 1, 8)
    with pytest.raises(ValueError, match="head dim 8 must be even, 16 to 256"):
        paged_attention_triton(q, torch.zeros(1, dtype=torch.long), torch.tensor([0, 1]), kv, kv,
                               torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                               torch.ones(8), 1.0, 0.25)
