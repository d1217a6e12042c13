"""A deviation floor: of the capped selection, only tokens deviating above the floor are
recomputed; the patch room left unused goes back to the pool."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import blend as blend_mod
from tokendance.backend.api import InvalidRequest
from tokendance.backend.engine import Engine
from tokendance.kernels.deviation import unpad

from .test_reuse import GREEDY, kv_of, prefill, round_prompts


def spied(monkeypatch) -> list:
    """Record (deviations, groups, picks) of every selection the blend makes, for the
    Mirrors in its batch."""
    seen = []
    real = blend_mod.select_top_padded

    def spy(dev, groups, ratio, floor=0.0):
        picks = real(dev, groups, ratio, floor)
        mirrors = [i for i, g in enumerate(groups) if len(g)]  # not the bases computed beside them
        seen.append((dev.clone(), [groups[i] for i in mirrors], [unpad(picks)[i] for i in mirrors]))
        return picks

    monkeypatch.setattr(blend_mod, "select_top_padded", spy)
    return seen


def test_floor_keeps_the_capped_picks_above_it(tiny_llama, monkeypatch):
    prompts, spans = round_prompts(4, seed=8)
    seen = spied(monkeypatch)
    capped = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    base, _ = prefill(capped, "collective", prompts, spans)
    (dev, groups, picks0), = seen
    chosen = torch.cat(picks0)
    floor = dev[chosen].median().item()  # about half the capped picks stay
    seen.clear()

    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, recompute_floor=floor)
    seqs, _ = prefill(eng, "collective", prompts, spans)
    (_, _, picks), = seen
    for p0, p, s0, s in zip(picks0, picks, base, seqs):
        assert p.tolist() == [i for i in p0.tolist() if dev[i] > floor]
        assert s.recomputed == len(p) < s0.recomputed
        # the unused patch room is gone: held slots are the prompt area, blocks cover it
        assert s.mirror.held(len(s)) == s.mirror.area == s0.mirror.area - (s0.recomputed - s.recomputed)
        assert len(s.blocks) == eng.blocks.blocks_for(s.mirror.area)
    assert eng.pool.num_free > capped.pool.num_free


def test_floor_above_everything_is_ratio_zero(tiny_llama):
    prompts, spans = round_prompts(3, seed=9)
    high = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, recompute_floor=1e9)
    zero = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, recompute_ratio=0.0)
    a, _ = prefill(high, "collective", prompts, spans)
    b, _ = prefill(zero, "collective", prompts, spans)
    for x, y in zip(a, b):
        assert x.recomputed == y.recomputed == 0
        assert x.mirror.area == y.mirror.area and len(x.blocks) == len(y.blocks)
        torch.testing.assert_close(kv_of(high, x), kv_of(zero, y))


@pytest.mark.parametrize("floor", [0.05, 1e9])
def test_pic_equals_collective_and_decode_runs_after_trim(tiny_llama, floor):
    prompts, spans = round_prompts(5, seed=10)
    outs = {}
    for mode in ("pic", "collective"):
        eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, recompute_floor=floor)
        outs[mode] = eng.generate(prompts, GREEDY, mode=mode, shared=spans)
        assert eng.pool.num_free == eng.pool.num_blocks - eng.segments.held
    assert outs["pic"] == outs["collective"]
    assert all(len(t) == GREEDY.max_tokens for t, _, _ in outs["pic"])


@pytest.mark.parametrize("kw, match", [(dict(recompute_floor=-0.1), "floor"),
                                       (dict(recompute_floor=float("nan")), "floor"),
                                       (dict(recompute_ratio=1.5), "ratio"),
                                       (dict(check_layer=0), "check layer")])
def test_bad_reuse_settings(tiny_llama, kw, match):
    with pytest.raises(InvalidRequest, match=match):
        Engine(model=str(tiny_llama), dtype="float32", kv_tokens=1024, **kw)
