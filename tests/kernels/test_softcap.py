"""Capped scores (Gemma 2: s -> cap * tanh(s / cap) before the mask): the references
against a naive definition, and every Triton path (interpreted) against the reference:
prefill from scratch and chunked, decode with splits, slot-position tables (Mirrors), the
Master read collectively, each with and without a sliding window; the fresh-prompt path
and the CPU's held rotated keys too."""

from __future__ import annotations

import pytest
import torch

import tokendance.kernels.paged_attention as pa
from tokendance.kernels import softcap
from tokendance.kernels.prefill import capped_triton, causal_attention
from tokendance.kernels.rope import rope_rotate
from tokendance.kernels.rotated import RotatedKeys, RotatedStep

from .test_master_decode import batch
from .test_paged_attention import B, Case, dense_attention, make_case, rel, run_triton, suffix
from .test_windows import CASES, poisoned  # noqa: F401 (poisoned: an autouse fixture)


def case(kind: str, d: int = 64) -> Case:
    lens, q_pos = CASES[kind]
    c = make_case(lens, q_pos(lens), hq=8, hkv=2, d=d)
    c.q *= 3  # scores of a few units: a cap of 1-3 bends most of them
    return c


@pytest.mark.parametrize("kind", list(CASES))
@pytest.mark.parametrize("cap,window", [(1.0, 0), (3.0, 0), (2.0, 20)])
def test_reference_matches_dense(kind: str, cap: float, window: int) -> None:
    c = case(kind)
    want = dense_attention(c, window, cap)
    assert rel(pa.paged_attention_reference(*c.args(), window=window, softcap=cap), want) < 1e-5
    assert rel(pa.paged_attention_reference(*c.args(), window=window), want) > 1e-2  # the cap shows


@pytest.mark.parametrize("cap", [1.0, 3.0])
def test_triton_prefill(cap: float) -> None:
    for kind in ("prefill", "chunked", "scattered"):
        c = case(kind)
        assert rel(run_triton(c, softcap=cap), pa.paged_attention_reference(*c.args(), softcap=cap)) < 1e-3


@pytest.mark.parametrize("window,step", [(0, "table"), (0, False), (33, True)])
def test_triton_prefill_steps_and_windows(window: int, step: bool | str) -> None:
    from tokendance.kernels.tiles import trig_table

    c = case("chunked")
    trig = trig_table(c.inv_freq, 128) if step == "table" else None
    got = run_triton(c, cfg=dict(step=step), trig=trig, window=window, softcap=2.0)
    assert rel(got, pa.paged_attention_reference(*c.args(), window=window, softcap=2.0)) < 1e-3


@pytest.mark.parametrize("window,splits", [(0, 1), (0, 4), (40, 2)])
def test_triton_decode(window: int, splits: int) -> None:
    c = case("decode")
    got = run_triton(c, num_splits=splits, window=window, softcap=1.5)
    assert rel(got, pa.paged_attention_reference(*c.args(), window=window, softcap=1.5)) < 1e-3


def test_triton_bf16() -> None:
    c = case("chunked", d=128)
    ref = pa.paged_attention_reference(*c.to(torch.bfloat16).to(torch.float32).args(), softcap=2.0)
    assert rel(run_triton(c.to(torch.bfloat16), softcap=2.0).float(), ref) < 2e-2


@pytest.mark.parametrize("window", [0, 24])
def test_mirror_tables_and_the_master_read(window: int) -> None:
    """Slot-position tables and the Master apart (collective): Triton equals the
    reference, and the reference's two parts merged equal the whole tables."""
    q, q_pos, cu, kc, vc, full, mine, read, inv = batch([40, 25, 33], [12, 30, 5, None])
    q = q * 3
    sm = q.shape[-1] ** -0.5
    kw = dict(window=window, softcap=1.0)
    want = pa.paged_attention_reference(q, q_pos, cu, kc, vc, *full[:2], inv, 1.0, sm, full[2], **kw)
    got = pa.paged_attention_triton(q, q_pos, cu, kc, vc, *full[:2], inv, 1.0, sm, full[2], num_splits=4, **kw)
    assert rel(got, want) < 1e-3
    ref = pa.paged_attention(q, q_pos, cu, kc, vc, *mine[:2], inv, 1.0, sm, slot_pos=mine[2], master=read, **kw)
    assert rel(ref, want) < 1e-5
    got = pa.master_decode_triton(q, q_pos, cu, kc, vc, *mine[:2], inv, 1.0, sm, mine[2], read, **kw)
    assert rel(got, ref) < 1e-3
    assert rel(pa.paged_attention_reference(q, q_pos, cu, kc, vc, *full[:2], inv, 1.0, sm, full[2],
                                            window=window), want) > 1e-2


@pytest.mark.parametrize("lens,window", [([40, 40], 0), ([300, 17], 0), ([300, 17], 50)])
def test_fresh_prompts(lens: list[int], window: int, monkeypatch) -> None:
    """A fresh prompt's causal attention (rows in blocks, and in a window's band) equals
    the definition over the same keys."""
    monkeypatch.setattr(softcap, "ROWS", 64)
    c = make_case(lens, suffix(lens, lens), hq=8, hkv=2)
    c.q *= 3
    cu = c.cu_q.tolist()
    k = torch.cat([c.k_cache[c.block_tables[s, : -(-n // B)].long()].flatten(0, 1)[:n]
                   for s, n in enumerate(lens)])
    v = torch.cat([c.v_cache[c.block_tables[s, : -(-n // B)].long()].flatten(0, 1)[:n]
                   for s, n in enumerate(lens)])
    k = rope_rotate(k, c.q_pos, c.inv_freq, c.rope_scale)
    want = dense_attention(c, window, 2.0)
    assert rel(causal_attention(c.q, k, v, cu, c.sm_scale, window=window, softcap=2.0), want) < 1e-5
    # CUDA's path: the paged kernel over the step's own K/V as one-slot blocks (interpreted)
    assert rel(capped_triton(c.q, k, v, cu, c.sm_scale, window, 2.0), want) < 1e-3


def test_held_rotated_keys_cap_too() -> None:
    """The CPU's decode over keys held rotated from step to step (gathered once, then a
    key appended a step) caps as the gathering reference does."""
    full = [40, 72]
    c = make_case(full, suffix(full, [1, 1]), hq=8, hkv=2)
    keys, rows, held = RotatedKeys(1 << 30, 1), ("a", "b"), []
    for back in (3, 2, 1, 0):  # contexts of 37 and 69 keys, then one more a step
        n = torch.tensor(full, dtype=torch.int32) - back
        pos = n.long() - 1
        slots = torch.stack([c.block_tables[s, p // B].long() * B + p % B for s, p in enumerate(pos.tolist())])
        q = torch.randn_like(c.q) * 3
        args = (q, pos, c.k_cache, c.v_cache, c.block_tables, n, c.inv_freq, 1.0, c.sm_scale)
        want = pa._decode_reference(*args, softcap=1.0)
        step = RotatedStep(keys, rows, pos.tolist(), slots)
        got = pa._decode_reference(*args, plan={"rotated": step}, softcap=1.0)
        assert rel(got, want) < 1e-5
        held += keys.held.values()
    assert len(held) == 4 and all(h is held[0] for h in held) and held[0].n == 72  # gathered once


def test_a_huge_cap_is_no_cap() -> None:
    c = case("chunked")
    assert rel(pa.paged_attention_reference(*c.args(), softcap=1e6), pa.paged_attention_reference(*c.args())) < 1e-5
