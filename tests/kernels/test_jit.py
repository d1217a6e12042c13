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


class Refusing:
    """A kernel that refuses, as short of shared memory, launches whose constexpr `name`
    exceeds `most`; notes each one's value in `seen`."""

    def __init__(self, kernel, name: str, most: int, seen: list):
        self.kernel, self.name, self.most, self.seen = kernel, name, most, seen

    def __getitem__(self, grid):
        def run(*args, **kw):
            from triton.runtime.errors import OutOfResources

            self.seen.append(kw[self.name])
            if kw[self.name] > self.most:
                raise OutOfResources(327680, 232448, "shared memory")
            self.kernel[grid](*args, **kw)
        return run


def test_a_launch_that_asks_too_much_shared_memory_takes_smaller_tiles(monkeypatch):
    """`fitting`: the first configuration that launches is kept for its kind; the prefill
    kernel falls back to smaller tiles (as on an H100 at head dim 256 in float32) and
    still computes the reference's result."""
    from triton.runtime.errors import OutOfResources

    import tokendance.kernels.paged_attention as pa
    import tokendance.kernels.paged_triton as pt
    from tokendance.kernels import jit

    from .test_paged_attention import make_case, rel, suffix

    monkeypatch.setattr(jit, "_FITS", {})
    tried = []

    def launch(c):
        tried.append(c["n"])
        if c["n"] > 2:
            raise OutOfResources(327680, 232448, "shared memory")

    assert jit.fitting(("k",), dict(n=4), [dict(n=3), dict(n=2), dict(n=1)], launch) == dict(n=2)
    assert jit.fitting(("k",), dict(n=4), [dict(n=3)], launch) == dict(n=2) and tried == [4, 3, 2, 2]
    with pytest.raises(OutOfResources):
        jit.fitting(("other",), dict(n=4), [dict(n=3)], launch)

    blocks = []
    monkeypatch.setattr(pt, "_prefill_kernel", Refusing(pt._prefill_kernel, "BLOCK_M", 16, blocks))
    lens = [40, 21]
    c = make_case(lens, suffix(lens, [40, 9]), hq=4, hkv=2)
    got = pt.paged_attention_triton(*c.args())
    assert blocks[0] == 32 and blocks[-1] == 16 and 16 not in blocks[:-1]
    assert rel(got, pa.paged_attention_reference(*c.args())) < 1e-3
    blocks.clear()
    pt.paged_attention_triton(*c.args())
    assert blocks == [16]  # kept


def test_a_decode_launch_refused_takes_one_stage_then_smaller_key_tiles(monkeypatch):
    """The decode kernel's fallbacks: one pipeline stage, then keys of 16; the result is
    the reference's, and the configuration that launched is kept."""
    import tokendance.kernels.paged_attention as pa
    import tokendance.kernels.paged_triton as pt
    from tokendance.kernels import jit

    from .test_paged_attention import make_case, rel, run_triton, suffix

    monkeypatch.setattr(jit, "_FITS", {})
    tiles = []
    monkeypatch.setattr(pt, "_decode_kernel", Refusing(pt._decode_kernel, "BLOCK_N", 16, tiles))
    lens = [40, 70, 9]
    c = make_case(lens, suffix(lens, [1, 1, 1]), hq=8, hkv=2)
    got = run_triton(c, num_splits=2, cfg=dict(block_n=64, num_stages=2))
    assert tiles == [64, 64, 16] and rel(got, pa.paged_attention_reference(*c.args())) < 1e-3
    tiles.clear()
    run_triton(c, num_splits=2, cfg=dict(block_n=64, num_stages=2))
    assert tiles == [16]  # kept


class Recording:
    """A kernel that notes each launch's register cap (None: uncapped) in `seen`."""

    def __init__(self, kernel, seen: list):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.seen.append(kw.get("maxnreg"))
            self.kernel[grid](*args, **kw)
        return run


def test_a_register_cap_reaches_the_decode_and_collective_launches(monkeypatch):
    """A configuration's maxnreg is passed to Triton (`launch_options`), the result still
    the reference's; the launcher caps an 8-bit pool's decode at head dims up to 128
    (plain, Mirrors' slot positions and windows, measured faster so; not capped scores)."""
    import tokendance.kernels.collective as col
    import tokendance.kernels.collective_triton as colt
    import tokendance.kernels.paged_attention as pa
    import tokendance.kernels.paged_triton as pt
    from tokendance.kernels.fp8 import FP8

    from . import test_collective as tc
    from .test_paged_attention import make_case, rel, run_triton, suffix

    seen: list = []
    monkeypatch.setattr(pt, "_decode_kernel", Recording(pt._decode_kernel, seen))
    lens = [40, 9]
    c = make_case(lens, suffix(lens, [1, 1]), hq=8, hkv=2)
    got = run_triton(c, num_splits=2, cfg=dict(maxnreg=128))
    assert seen == [128] and rel(got, pa.paged_attention_reference(*c.args())) < 1e-3
    run_triton(c, num_splits=2)
    assert seen == [128, None]  # not on the CPU's interpreter, where nothing compiles

    monkeypatch.setattr(colt, "_collective_kernel", Recording(colt._collective_kernel, seen))
    m = tc.make_case(3, 8, 2, 32)
    got = tc.run_triton(m, num_splits=2, cfg=dict(maxnreg=96))
    assert seen[-1] == 96 and rel(got[0], col.collective_attention_reference(*m.args())[0]) < 1e-3

    e4m3 = FP8["fp8"]
    assert pt.decode_cap(e4m3, 128) == pt.decode_cap(e4m3, 64) == dict(maxnreg=128)
    assert pt.decode_cap(e4m3, 256) == pt.decode_cap(e4m3, 128, softcap=50.0) == {}
    assert pt.decode_cap(torch.bfloat16, 128) == {}
