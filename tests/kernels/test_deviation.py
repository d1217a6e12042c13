"""KV deviation kernel vs its reference; batched top-k vs the per-request reference."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels import deviation as dv


@pytest.mark.parametrize("t,h,d", [(1, 3, 64), (37, 3, 64), (70, 4, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(t, h, d, dtype):
    g = torch.Generator().manual_seed(t * h + d)
    kn, vn, ko, vo = (torch.randn(t, h, d, generator=g).to(dtype) for _ in range(4))
    ref = dv.kv_deviation_reference(kn, vn, ko, vo)
    out = dv.kv_deviation_triton(kn, vn, ko, vo)
    assert torch.isfinite(out).all()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize("t,h,d", [(1, 3, 64), (37, 4, 128)])
def test_triton_parts_match_reference(t, h, d):
    g = torch.Generator().manual_seed(t + h)
    kn, vn, ko, vo = (torch.randn(t, h, d, generator=g) for _ in range(4))
    ref = dv.kv_deviation_parts_reference(kn, vn, ko, vo)
    out = dv.kv_deviation_triton(kn, vn, ko, vo, parts=True)
    assert out.shape == (t, 4)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_parts_of_split_heads_add_up():
    """Tensor parallelism: two ranks' parts of half the heads each, summed, give the
    whole model's deviation."""
    g = torch.Generator().manual_seed(3)
    kn, vn, ko, vo = (torch.randn(9, 4, 16, generator=g) for _ in range(4))
    halves = [dv.kv_deviation_parts_reference(*(x[:, sl] for x in (kn, vn, ko, vo)))
              for sl in (slice(0, 2), slice(2, 4))]
    whole = dv.kv_deviation_reference(kn, vn, ko, vo)
    got = dv.kv_deviation(kn[:, :2], vn[:, :2], ko[:, :2], vo[:, :2], reduce=lambda p: p + halves[1])
    torch.testing.assert_close(got, whole)
    torch.testing.assert_close(dv.combine(halves[0] + halves[1]), whole)


def test_reference_definition():
    kn, vn = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    ko, vo = kn.clone(), vn.clone()
    ko[2] += 1.0
    dev = dv.kv_deviation_reference(kn, vn, ko, vo)
    assert dev[2] > 0 and torch.count_nonzero(dev) == 1
    want = (16.0 / kn[2].pow(2).sum()).item()
    assert dev[2].item() == pytest.approx(want, rel=1e-5)


def test_select_top_batched_equals_reference():
    g = torch.Generator().manual_seed(0)
    dev = torch.rand(300, generator=g)
    groups = [torch.arange(0, 40), torch.arange(50, 51), torch.arange(60, 60), torch.arange(100, 300, 3)]
    for ratio in (0.0, 0.15, 0.5, 1.0):
        a = dv.select_top(dev, groups, ratio)
        b = dv.select_top_reference(dev, groups, ratio)
        assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_floor_keeps_only_what_deviates():
    g = torch.Generator().manual_seed(1)
    dev = torch.rand(300, generator=g)
    groups = [torch.arange(0, 40), torch.arange(50, 51), torch.arange(60, 60), torch.arange(100, 300, 3)]
    for ratio in (0.15, 0.5, 1.0):
        for floor in (0.3, 0.9, 2.0):
            a = dv.select_top(dev, groups, ratio, floor)
            b = dv.select_top_reference(dev, groups, ratio, floor)
            assert [x.tolist() for x in a] == [x.tolist() for x in b]
            capped = dv.select_top(dev, groups, ratio)
            for idx, pick, cap in zip(groups, a, capped):
                # the capped selection's tokens above the floor, no more, no fewer
                assert pick.tolist() == [i for i in cap.tolist() if dev[i] > floor]
                assert len(pick) <= len(cap)
    assert all(len(x) == 0 for x in dv.select_top(dev, groups, 1.0, 2.0))
    # a floor below every deviation changes nothing
    assert ([x.tolist() for x in dv.select_top(dev, groups, 0.15, 1e-9)]
            == [x.tolist() for x in dv.select_top(dev, groups, 0.15)])
