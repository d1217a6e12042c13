"""An install without Triton (it is an optional extra) serves through the references."""

from __future__ import annotations

import subprocess
import sys

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
