"""Fresh-prefill attention equals paged attention over the same, freshly stored KV."""

from __future__ import annotations

import pytest
import torch

from tokendance.kernels.paged_attention import paged_attention_reference
from tokendance.kernels import prefill
from tokendance.kernels.prefill import causal_attention
from tokendance.kernels.rope import rope_rotate_reference


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("lens", [[5], [7, 7, 7], [3, 17, 17, 1, 40]])
def test_equals_paged_reference(lens, window, monkeypatch):
    monkeypatch.setattr(prefill, "BAND_ROWS", 4)  # a window's rows in several calls
    g = torch.Generator().manual_seed(sum(lens))
    hq, hkv, d, b = 6, 2, 32, 4
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    inv = 1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    pos = torch.cat([torch.arange(n) for n in lens])
    # Store K (un-rotated) and V into shuffled blocks, as the engine would.
    nblocks = sum(-(-n // b) for n in lens)
    perm = torch.randperm(nblocks, generator=g)
    kc = torch.full((nblocks, b, hkv, d), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    width = max(-(-n // b) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // b)
        tables[i, :nb] = perm[used: used + nb].int()
        used += nb
        for j in range(n):
            blk, off = int(tables[i, j // b]), j % b
            kc[blk, off], vc[blk, off] = k[cu[i] + j], v[cu[i] + j]
    qr = rope_rotate_reference(q, pos, inv)
    ref = paged_attention_reference(qr, pos, torch.tensor(cu, dtype=torch.int32), kc, vc, tables,
                                    torch.tensor(lens, dtype=torch.int32), inv, 1.0, d ** -0.5,
                                    window=window)
    out = causal_attention(qr, rope_rotate_reference(k, pos, inv), v, cu, d ** -0.5, window=window)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 100)])
def test_varlen_launch_equals_one_call_per_sequence_on_cuda(dtype, window):
    """Sequences of several lengths go through one varlen flash launch on CUDA; each
    must equal its own causal SDPA call (GQA: 28 query heads over 4 kv heads), in a
    sliding window too."""
    g = torch.Generator(device="cuda").manual_seed(3)
    lens = [150, 37, 512, 1, 150, 90]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], h, 128, generator=g, device="cuda", dtype=dtype) for h in (28, 4, 4))
    out = torch.full_like(q, float("nan"))
    out.copy_(causal_attention(q, k, v, cu, 128 ** -0.5, torch.tensor(cu, dtype=torch.int32, device="cuda"),
                               window))
    for a, b in zip(cu, cu[1:]):
        i = torch.arange(b - a, device="cuda")
        mask = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) if window else True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
            attn_mask=mask, scale=128 ** -0.5, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[a:b].float(), ref, rtol=2e-2, atol=2e-2)
