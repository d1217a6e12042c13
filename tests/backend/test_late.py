"""The late view a blend builds on the device from its picks (backend/late.py) equals the
one the host builds from the same picks once the Mirrors hold them (tables.kv_view)."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend import blend as blend_mod
from tokendance.backend import late as late_mod
from tokendance.backend.engine import Engine
from tokendance.backend.mirror import LATE
from tokendance.backend.tables import kv_view
from tests.backend.test_idle import next_round, run
from tests.backend.test_reuse import round_prompts


@pytest.fixture()
def spy(monkeypatch):
    """Checks every late view a blend builds against the host's, as the blend returns
    (its Mirrors hold their picks then, and nothing has been decoded yet); returns the
    checked views' plan arguments, with "picked": how many picks each compared."""
    calls = []
    real_plan, real_meta, real_blend = late_mod.plan, late_mod.Plan.meta, blend_mod.blend

    def plan(seqs, reused, starts, offsets, block_size, trash, device):
        calls.append(dict(seqs=seqs, reused=reused, starts=starts, offsets=offsets,
                          block_size=block_size, trash=trash))
        return real_plan(seqs, reused, starts, offsets, block_size, trash, device)

    def meta(self, picks, counts):
        out = real_meta(self, picks, counts)
        calls[-1].update(picks=picks.clone(), counts=counts, got=out)
        return out

    def blend(*a, **kw):
        res = real_blend(*a, **kw)
        calls[-1]["picked"] = check(calls[-1])
        return res

    monkeypatch.setattr("tokendance.backend.blend.plan", plan)
    monkeypatch.setattr(late_mod.Plan, "meta", meta)
    monkeypatch.setattr("tokendance.backend.collector.blend", blend)
    return calls


def check(c: dict) -> int:
    """Compare one recorded view with the host's; returns how many picks it holds."""
    rows, take, picked = [], [], 0
    for i, (r, start) in enumerate(zip(c["reused"], c["starts"])):
        off = c["offsets"][i]
        p = c["picks"][i].cpu()
        sel = p[p >= 0] - off + start
        assert len(sel) == c["counts"][i]
        picked += len(sel)
        keep = ~r
        keep[sel] = True
        keep[:start] = False
        rows.append(torch.nonzero(keep).flatten())
        take.append(rows[-1] - start + off)
    want = kv_view(c["seqs"], rows, LATE, c["block_size"], c["trash"], torch.device("cpu"))
    meta, kept = c["got"]
    assert torch.equal(kept.cpu(), torch.cat(take))  # the engine's, on its device
    assert torch.equal(meta.positions.cpu(), torch.cat(rows))
    assert torch.equal(meta.cu_q.long().cpu(), torch.tensor([0] + [len(r) for r in rows]).cumsum(0))
    assert meta.max_q == max(len(r) for r in rows)
    for key in ("slots", "block_tables", "kv_lens", "slot_pos"):
        assert torch.equal(getattr(meta, key).cpu(), want[key]), key
    return picked


@pytest.mark.parametrize("mode", ["collective", "pic"])
@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_cold_round(tiny_llama, spy, mode, floor):
    """Bases computed in the blend's forward (collective) or before it (pic), and a
    floor that picks fewer than the cap."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192, recompute_floor=floor)
    prompts, spans = round_prompts(4, seed=31)
    run(eng, prompts, spans, mode, "r", agents=False)
    assert spy and sum(c["picked"] for c in spy) > 0
    if mode == "collective":
        assert any(s.mirror is None for c in spy for s in c["seqs"])


def test_later_check_layer(make_model, spy):
    """Check layer 2: every reused token has its own slot, a pick is patched there."""
    eng = Engine(model=str(make_model("llama", num_hidden_layers=4)), dtype="float32",
                 kv_tokens=8192, check_layer=2)
    prompts, spans = round_prompts(3, seed=32)
    run(eng, prompts, spans, "collective", "r", agents=False)
    assert sum(c["picked"] for c in spy) > 0


def test_resumed_agents(tiny_llama, spy):
    """A second round whose prompts start with a restored prefix (start > 0) holding
    the last round's patches."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=8192)
    prompts, spans = round_prompts(3, seed=33)
    outs, _ = run(eng, prompts, spans, "collective", "a")
    spy.clear()
    prompts, spans = next_round(prompts, spans, outs, seed=34)
    run(eng, prompts, spans, "collective", "b")
    assert any(s > 0 for c in spy for s in c["starts"])
    assert sum(c["picked"] for c in spy) > 0
