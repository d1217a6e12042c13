"""MoE experts: the Triton path (interpreted on CPU) against the reference, the align
step's invariants, and the reference against transformers' Qwen3MoeExperts."""

from __future__ import annotations

import pytest
import torch

import tokendance.kernels.moe as moe_mod
from tokendance.kernels.moe import align, align_reference, align_triton, moe, moe_reference, moe_triton


def make(T: int, H: int, I: int, E: int, k: int, dtype: torch.dtype = torch.float32,
         seed: int = 0, hot: int | None = None) -> tuple[torch.Tensor, ...]:
    """x, gate_up, down, weights, ids; with `hot`, every token's first choice is that expert."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(E, H, I, generator=g) / I ** 0.5
    rows = []
    for _ in range(T):
        perm = torch.randperm(E, generator=g)
        if hot is not None:
            perm = torch.cat([torch.tensor([hot]), perm[perm != hot]])
        rows.append(perm[:k])
    ids = torch.stack(rows) if T else torch.zeros(0, k, dtype=torch.int64)
    weights = torch.randn(T, k, generator=g).softmax(-1)
    return x.to(dtype), gate_up.to(dtype), down.to(dtype), weights.to(dtype), ids


# (T, H, I, E, k, hot). H=44, I=20: with 16-wide tiles every GEMM's N and K have a partial tile.
CASES = {
    "prefill": (16, 44, 20, 8, 2, None),
    "decode": (1, 44, 20, 8, 2, None),
    "few_pairs": (2, 44, 20, 8, 2, None),  # T*k < E: most experts unused
    "uneven": (40, 44, 20, 8, 2, 5),  # every token on expert 5: several blocks of it
    "top4": (6, 32, 16, 8, 4, None),  # tile-exact sizes
}


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        # bf16 rounds h, the activation and y on both paths at different points (the
        # reference also each weighted y and the running sum): a few ulps of the output's
        # scale, where a wrong row, expert, weight or mask is off by the scale itself.
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -6, atol=2 ** -5 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_reference(case: str, dtype: torch.dtype) -> None:
    T, H, I, E, k, hot = CASES[case]
    args = make(T, H, I, E, k, dtype, seed=len(case), hot=hot)
    out = moe_triton(*args)
    assert out.shape == (T, H) and out.dtype == dtype
    close(out, moe_reference(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_other_tiles(dtype: torch.dtype) -> None:
    """cfg overrides the tiles: 32-wide ones leave partial tiles of H=48, I=40 everywhere."""
    args = make(12, 48, 40, 8, 2, dtype, seed=3, hot=1)
    close(moe_triton(*args, cfg=dict(block_m=32, block_n=32, block_k=32)), moe_reference(*args))


def test_no_tokens() -> None:
    args = make(0, 44, 20, 8, 2)
    out = moe_triton(*args)
    assert out.shape == (0, 44) and out.dtype == torch.float32
    assert moe_reference(*args).shape == (0, 44)


@pytest.mark.parametrize("T,k,E,bm", [(16, 2, 8, 16), (1, 2, 8, 16), (3, 2, 8, 4), (40, 2, 8, 16),
                                      (33, 4, 64, 8), (5, 1, 3, 1), (0, 2, 8, 16)])
def test_align(T: int, k: int, E: int, bm: int) -> None:
    _, _, _, _, ids = make(T, 8, 8, E, k, seed=T + E, hot=2 if T == 40 else None)
    pairs, block_expert = align(ids, E, bm)
    n = T * k
    size = -(-(n + min(E, n) * (bm - 1)) // bm) * bm
    assert pairs.shape == (size,) and block_expert.shape == (size // bm,)
    assert pairs.dtype == block_expert.dtype == torch.int32
    real = pairs[pairs < n]
    assert torch.equal(real.sort().values, torch.arange(n, dtype=torch.int32))  # each once
    assert bool((pairs <= n).all())  # the rest are the sentinel
    flat = ids.reshape(-1)
    used = int((block_expert >= 0).sum())
    assert bool((block_expert[used:] == -1).all()) and bool((pairs[used * bm:] == n).all())
    assert used == int(((torch.bincount(flat, minlength=E) + bm - 1) // bm).sum())
    assert torch.equal(block_expert[:used], block_expert[:used].sort().values)
    for b in range(used):
        blk = pairs[b * bm:(b + 1) * bm]
        live = blk[blk < n].long()
        assert len(live) > 0 and bool((blk[len(live):] == n).all())  # padding at the end
        assert bool((flat[live] == int(block_expert[b])).all())  # one expert's pairs
        assert bool((live[1:] > live[:-1]).all())  # in ascending order


@pytest.mark.parametrize("T,k,E,bm", [(16, 2, 8, 16), (1, 2, 8, 16), (3, 2, 8, 4), (40, 2, 8, 16), (33, 4, 64, 8),
                                      (5, 1, 3, 1), (0, 2, 8, 16), (300, 8, 128, 64), (7, 8, 128, 64),
                                      (100, 2, 7, 16), (64, 4, 60, 128)])
def test_align_triton_equals_the_reference(T: int, k: int, E: int, bm: int) -> None:
    """The sort and two launches give the reference's pairs and blocks exactly: every
    expert used, few used (7 tokens of 128 experts), one hot expert, an expert count that
    is not a power of two, blocks wider than any group."""
    _, _, _, _, ids = make(T, 8, 8, E, k, seed=T + E + 1, hot=1 if T in (40, 100) else None)
    want, got = align_reference(ids, E, bm), align_triton(ids, E, bm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("hot", [None, 0])
def test_reference_is_transformers(hot: int | None) -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    T, H, I, E, k = 9, 44, 20, 8, 2
    x, gate_up, down, weights, ids = make(T, H, I, E, k, seed=7, hot=hot)
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=k, hidden_act="silu")
    experts = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        want = experts(x, ids, weights)
    got = moe_reference(x, gate_up, down, weights, ids)
    assert got.abs().max() > 0.1
    assert torch.equal(got, want)  # the same ops in the same order


def test_cpu_dispatch_is_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **kw):
        raise AssertionError("moe_triton on CPU tensors")

    monkeypatch.setattr(moe_mod, "moe_triton", boom)
    args = make(5, 44, 20, 8, 2)
    assert torch.equal(moe(*args), moe_reference(*args))
    # bf16: torch's grouped GEMM where its rows are 16-byte aligned, else the reference
    args = make(5, 48, 24, 8, 2, torch.bfloat16)
    assert torch.equal(moe(*args), moe_mod.moe_grouped(*args))
    args = make(5, 44, 20, 8, 2, torch.bfloat16)
    assert not moe_mod.groupable(*args[:3]) and torch.equal(moe(*args), moe_reference(*args))


def test_paths_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA: Triton at every step size, dtype and alignment."""
    class Cuda:
        def __init__(self, t: torch.Tensor):
            self.t, self.is_cuda, self.dtype, self.shape = t, True, t.dtype, t.shape

        def __getattr__(self, name):
            return getattr(self.t, name)

    monkeypatch.setattr(moe_mod, "HAVE_TRITON", True)
    for t, h, dtype in ((7, 48, torch.bfloat16), (8, 48, torch.float32), (8, 44, torch.bfloat16)):
        x, gate_up, down, _, _ = make(t, h, 24, 4, 2, dtype)
        assert moe_mod.path(Cuda(x), gate_up, down) == "triton", (t, h, dtype)


def test_launch_by_tokens() -> None:
    """Each step size takes the configuration of the last start it reaches."""
    (_, small), (mid, medium), (big, large) = moe_mod.CFGS
    assert moe_mod.launch(1) is small and moe_mod.launch(mid - 1) is small
    assert moe_mod.launch(mid) is medium and moe_mod.launch(big - 1) is medium
    assert moe_mod.launch(big) is large and moe_mod.launch(10 ** 6) is large


@pytest.mark.parametrize("start", [s for s, _ in moe_mod.CFGS])
def test_triton_gpu_tiles(start: int) -> None:
    """The GPU's configurations (tiles of 64 to 256, wider than H=48 and I=40) compute the
    reference's answer; the interpreter runs them as a GPU would, tiles and masks."""
    args = make(12, 48, 40, 8, 2, torch.bfloat16, seed=5, hot=1)
    close(moe_triton(*args, cfg=moe_mod.launch(start)), moe_reference(*args))


@pytest.mark.skipif(moe_mod.GROUPED_MM is None, reason="torch has no F.grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["prefill", "decode", "few_pairs", "uneven"])
def test_grouped_matches_reference(case: str, dtype: torch.dtype) -> None:
    T, _, _, E, k, hot = CASES[case]
    args = make(T, 48, 24, E, k, dtype, seed=3, hot=hot)  # rows of 16 bytes' multiples
    close(moe_mod.moe_grouped(*args), moe_reference(*args))
