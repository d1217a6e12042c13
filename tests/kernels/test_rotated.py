"""CPU decode over held rotated keys (kernels/rotated.py) against the gathering path,
step by step: plain sequences of several lengths, Mirror-like slot positions with hidden
slots, bf16 pools, and every reason to gather again."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels import paged_attention as pa
from tokendance.kernels import rotated
from tokendance.kernels.rotated import RotatedKeys, RotatedStep

HQ, HKV, D, B = 6, 2, 32, 4
INV = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))


class Batch:
    """Sequences decoding in a paged pool: seq s owns blocks table[s]; with `mirror`,
    its slots sit at shuffled positions and some hide (a Mirror's table)."""

    def __init__(self, lens: list[int], dtype: torch.dtype, mirror: bool = False, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.room = list(lens), max(lens) + 40
        per = -(-self.room // B)
        self.k = torch.randn(len(lens) * per + 1, B, HKV, D, generator=g).to(dtype)
        self.v = torch.randn(self.k.shape, generator=g).to(dtype)
        self.table = torch.randperm(len(lens) * per, generator=g).view(len(lens), per).int()
        self.pos = None
        if mirror:  # slot j of the prompt at a shuffled position, every fifth hidden
            self.pos = torch.full((len(lens), per * B), -1, dtype=torch.int32)
            for s, n in enumerate(lens):
                p = torch.randperm(n, generator=g).int()
                p[::5] = -1
                self.pos[s, :n] = p
        self.rows = tuple(object() for _ in lens)
        self.g = g

    def step(self, keys: RotatedKeys | None, dtype: torch.dtype, window: int = 0):
        """Each sequence's next token (stored at its next slot, at its next position), its
        queries in `dtype`: (attention with `keys`, attention gathering), in a sliding
        window if not 0."""
        s = len(self.lens)
        qpos = torch.tensor(self.lens)
        slots = self.table.long()[torch.arange(s), qpos // B] * B + qpos % B
        if self.pos is not None:
            self.pos[torch.arange(s), qpos] = qpos.int()
        flat_k, flat_v = self.k.view(-1, HKV, D), self.v.view(-1, HKV, D)
        flat_k[slots] = torch.randn(s, HKV, D, generator=self.g).to(self.k.dtype)
        flat_v[slots] = torch.randn(s, HKV, D, generator=self.g).to(self.k.dtype)
        self.lens = [n + 1 for n in self.lens]
        kv_lens = torch.tensor(self.lens, dtype=torch.int32)
        if self.pos is not None:  # a Mirror reads its whole table
            kv_lens = torch.full_like(kv_lens, self.table.shape[1] * B)
        q = torch.randn(s, HQ, D, generator=self.g).to(dtype)
        args = (q, qpos, self.k, self.v, self.table, kv_lens, INV, 1.0, D ** -0.5, self.pos)
        want = pa._decode_reference(*args, plan={}, window=window)
        if keys is None:
            return None, want
        plan = {"rotated": RotatedStep(keys, self.rows, qpos.tolist(), slots)}
        return pa._decode_reference(*args, plan=plan, window=window), want


def gathers(monkeypatch) -> list[int]:
    calls = []
    real = rotated._gather
    monkeypatch.setattr(rotated, "_gather", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mirror", [False, True])
def test_held_keys_equal_gathering_every_step(monkeypatch, dtype, mirror):
    calls = gathers(monkeypatch)
    batch = Batch([9, 23, 16], dtype, mirror=mirror, seed=int(mirror))
    keys = RotatedKeys(1 << 30, 1)
    for _ in range(12):
        got, want = batch.step(keys, dtype)
        assert got.dtype == dtype
        # both sum in float32, in other orders: a bf16 output may round one step apart
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=1e-5)
    assert len(calls) == 1  # the first step gathered; the others appended


@pytest.mark.parametrize("mirror", [False, True])
def test_held_keys_leave_a_sliding_window(monkeypatch, mirror):
    """The held keys stay; each step masks the ones its rows' windows left behind."""
    calls = gathers(monkeypatch)
    batch = Batch([9, 23, 16], torch.float32, mirror=mirror, seed=8)
    keys = RotatedKeys(1 << 30, 1)
    for _ in range(12):
        got, want = batch.step(keys, torch.float32, window=6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 1


def test_each_layer_holds_its_own(monkeypatch):
    """Two layers (two pools) decode the same batch: each keeps its keys."""
    calls = gathers(monkeypatch)
    keys = RotatedKeys(1 << 30, 2)
    a, b = Batch([5, 30], torch.float32, seed=3), Batch([5, 30], torch.float32, seed=4)
    b.rows = a.rows
    for _ in range(5):
        for batch in (a, b):
            got, want = batch.step(keys, torch.float32)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 2 and len(keys.held) == 2


@pytest.mark.parametrize("change", ["rows", "jump", "full"])
def test_gathers_again_when_the_held_keys_cannot_serve(monkeypatch, change):
    calls = gathers(monkeypatch)
    keys = RotatedKeys(1 << 30, 1)
    batch = Batch([7, 12], torch.float32, seed=5)
    if change == "full":
        monkeypatch.setattr(rotated, "SPARE", 2)
    for i in range(7):
        if i == 3 and change == "rows":  # another batch, same tensors: another sequence
            batch.rows = (batch.rows[0], object())
        if i == 3 and change == "jump":  # a step that did not go through here
            batch.step(None, torch.float32)
        got, want = batch.step(keys, torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == {"rows": 2, "jump": 2, "full": 3}[change]


def test_over_budget_gathers_per_step(monkeypatch):
    calls = gathers(monkeypatch)
    batch = Batch([20, 20], torch.float32, seed=6)

    def need(keys: int) -> int:  # K and V of 2 rows, float32, the gathered keys + SPARE
        return 2 * 2 * HKV * (keys + rotated.SPARE) * D * 4

    keys = RotatedKeys(0, 1)
    for step in range(3):
        keys.budget = need(21 + step) - 1  # one byte short of holding this step's keys
        got, want = batch.step(keys, torch.float32)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the gathering path itself
    assert len(calls) == 3 and not keys.held
    keys.budget = need(24)
    batch.step(keys, torch.float32)
    assert len(keys.held) == 1
    keys.clear()
    assert not keys.held


def test_merge_path_ignores_held_keys():
    """With lse (a Mirror's own part, merged with the Master's) decode gathers."""
    batch = Batch([8], torch.float32, seed=7)
    keys = RotatedKeys(1 << 30, 1)
    q = torch.randn(1, HQ, D)
    plan = {"rotated": RotatedStep(keys, batch.rows, [8], torch.tensor([0]))}
    o, lse = pa._decode_reference(q, torch.tensor([7]), batch.k, batch.v, batch.table,
                                  torch.tensor([8], dtype=torch.int32), INV, 1.0, D ** -0.5,
                                  lse=True, plan=plan)
    assert lse.shape == (1, HQ) and not keys.held


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_steps_rotation_matrices_rotate_queries_as_rope_does(dtype):
    # A CPU decode step over held keys rotates its queries by the matrices it makes once
    # for every layer of one RoPE (backend/model.py, Attention.store): as kernels/rope.py does.
    from tokendance.kernels.rope import rope_rotate_reference

    torch.manual_seed(3)
    qpos = [5, 300, 4095, 0]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    step = RotatedStep(RotatedKeys(1 << 30, 2), tuple(range(4)), qpos, torch.zeros(4, dtype=torch.long))
    q = torch.randn(4, 9, 64).to(dtype)
    for scale in (1.0, 1.3):
        step.rot.clear()
        got = torch.bmm(q.float(), step.rotation(inv_freq, scale)).to(dtype)
        want = rope_rotate_reference(q, torch.tensor(qpos), inv_freq, scale)
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
    # a NoPE layer's (all angles zero) is the identity, made beside the other, not in its place
    nope = torch.zeros_like(inv_freq)
    assert torch.equal(step.rotation(nope, 1.0), torch.eye(64).expand(4, 64, 64))
    assert step.rotation(inv_freq, 1.3) is not step.rotation(nope, 1.0) and len(step.rot) == 2
