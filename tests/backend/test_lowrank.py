"""Low-rank K/V (KVCMAS's anchors): near the truncated SVD, smaller, exact where it cannot save."""

from __future__ import annotations

import pytest
import torch

from tokendance.backend.lowrank import LowRank, dense, factor, factor_all, nbytes


def decaying(L: int, n: int, H: int, D: int, seed: int, rank: int = 64) -> torch.Tensor:
    """[L, 2, n, H, D] whose singular values per layer and K / V fall off as 0.85^i."""
    g = torch.Generator().manual_seed(seed)
    rank = min(rank, n, H * D)
    u = torch.linalg.qr(torch.randn(L, 2, n, rank, generator=g)).Q
    v = torch.linalg.qr(torch.randn(L, 2, H * D, rank, generator=g)).Q.mT
    s = 0.85 ** torch.arange(rank, dtype=torch.float32)
    return ((u * s) @ v).unflatten(-1, (H, D))


def svd_error(x: torch.Tensor, rank: int) -> torch.Tensor:
    """The truncated SVD's relative error per layer and K / V: the best any rank-r gets."""
    m = x.flatten(3)
    s = torch.linalg.svdvals(m)
    return s[..., rank:].pow(2).sum(-1).sqrt() / s.pow(2).sum(-1).sqrt()


@pytest.mark.parametrize("rank", [8, 16, 32])
def test_within_ten_percent_of_the_truncated_svd(rank):
    x = decaying(3, 96, 3, 64, seed=rank)
    lr = factor(x, rank)
    assert isinstance(lr, LowRank) and lr.shape == x.shape
    got = (dense(lr) - x).flatten(2).norm(dim=-1) / x.flatten(2).norm(dim=-1)
    best = svd_error(x, rank)
    assert (got >= best - 1e-5).all()  # no rank-r product beats the SVD: the check can fail
    assert (got <= best * 1.1 + 1e-4).all()


def test_it_holds_fewer_bytes_in_the_tensors_dtype():
    x = decaying(2, 150, 4, 128, seed=1).to(torch.bfloat16)
    lr = factor(x, 32)
    assert lr.u.dtype == lr.v.dtype == torch.bfloat16 and dense(lr).dtype == torch.bfloat16
    assert nbytes(lr) == 2 * 2 * 32 * (150 + 512) * 2
    assert nbytes(x) / nbytes(lr) > 3.5


def test_where_factors_would_not_be_smaller_the_tensor_stays():
    x = torch.randn(2, 2, 20, 3, 64)  # 20 tokens: rank 32 saves nothing
    assert factor(x, 32) is x
    assert factor(x, 0) is x


def test_a_low_rank_tensor_comes_back_exactly():
    x = decaying(2, 80, 2, 32, seed=3, rank=8)  # rank 8 exactly
    torch.testing.assert_close(dense(factor(x, 8)), x, rtol=1e-4, atol=1e-5)


def test_zero_rows_do_not_break_it():
    x = decaying(2, 64, 2, 32, seed=4)
    x[:, :, 10:] = 0
    torch.testing.assert_close(dense(factor(x, 16)), x, rtol=1e-4, atol=1e-5)  # rank <= 10
    z = torch.zeros(1, 2, 64, 2, 32)
    assert torch.equal(dense(factor(z, 16)), z)


def test_factored_together_as_alone():
    """A step's anchors in one batch, padded to the longest, some in a chunk of their
    own, one too short to factor: each comes out as it does alone."""
    xs = [decaying(2, n, 2, 32, seed=n, rank=12) for n in (50, 80, 64, 6)]
    alone = [factor(x, 8) for x in xs]
    for chunk in (1 << 30, 2 * 2 * 80 * 64 * 4 * 2):  # all in one batch; 50 and 80 in one, 64 alone
        together = factor_all(xs, 8, chunk)
        assert together[3] is xs[3] and alone[3] is xs[3]
        for a, t in zip(alone[:3], together[:3]):
            assert t.u.shape == a.u.shape and t.v.shape == a.v.shape
            torch.testing.assert_close(dense(t), dense(a), rtol=1e-4, atol=1e-5)
