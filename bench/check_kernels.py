"""Triton kernels against their torch references on CUDA, at Qwen2.5-7B's sizes, with
both timed: the diff encode, the KV deviation's sums, the fused SwiGLU activation. Run
by bench/check_cuda.py (`act` alone: python -m tokendance.bench.check_cuda act)."""

from __future__ import annotations

import torch

from tokendance.bench.shapes import SHAPES


def diff_vs_reference() -> tuple[bool, float, float]:
    """Diff encode (kernels/diff.py) on a Qwen2.5-7B-shaped pool in bf16 (28 layers, 4 kv
    heads of 128), 3,000 token pairs, a third of them equal: the kernel's (early, late)
    equal the reference's exactly; both timed (median ms, bench/kernel_timing.py)."""
    import triton

    from tokendance.kernels.diff import kv_diff_reference, kv_diff_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(28, 2, 800, 16, 4, 128, device="cuda", generator=g).to(torch.bfloat16)
    slots = 800 * 16
    a = torch.randperm(slots, device="cuda", generator=g)[:3000]
    b = torch.randperm(slots, device="cuda", generator=g)[:3000]
    b[:1000] = a[:1000]
    ref = kv_diff_reference(kv, a, b, 1)
    out = kv_diff_triton(kv, a, b, 1)
    same = all(torch.equal(x, y) for x, y in zip(ref, out)) and bool((ref[1][:1000] == 0).all())
    ms = [triton.testing.do_bench(lambda f=f: f(kv, a, b, 1), return_mode="median")
          for f in (kv_diff_triton, kv_diff_reference)]
    return same, *ms


def deviation_parts_vs_reference() -> float:
    """The deviation kernel's sums (what tensor-parallel ranks add up, kernels/deviation.py)
    on a Qwen2.5-7B-shaped check layer in bf16 (4,000 tokens, 4 kv heads of 128): their
    largest relative error against the reference's."""
    from tokendance.kernels.deviation import kv_deviation_parts_reference, kv_deviation_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    kn, vn, ko, vo = (torch.randn(4000, 4, 128, device="cuda", generator=g).to(torch.bfloat16)
                      for _ in range(4))
    ref = kv_deviation_parts_reference(kn, vn, ko, vo)
    got = kv_deviation_triton(kn, vn, ko, vo, parts=True)
    return ((got - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()


def silu_mul_vs_reference() -> tuple[float, float, float]:
    """The fused SwiGLU activation on a Qwen2.5-7B-sized prefill (4 k rows, bf16): its
    largest relative error against the two torch ops (bf16 keeps 8 bits: 2^-6 is two
    roundings), and both times (median ms, bench/kernel_timing.py)."""
    from tokendance.bench.kernel_timing import median_ms
    from tokendance.kernels.act import silu_mul_reference, silu_mul_triton

    x = torch.randn(4096, 2 * SHAPES["qwen2.5-7b"]["intermediate_size"], device="cuda",
                    dtype=torch.bfloat16) * 4
    ref, got = silu_mul_reference(x).float(), silu_mul_triton(x).float()
    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()
    return rel, median_ms(lambda: silu_mul_triton(x), False), median_ms(lambda: silu_mul_reference(x), False)


def act() -> bool:
    rel, fused, ref = silu_mul_vs_reference()
    print(f"silu * up, 4096 x 18944 bf16: fused {fused:.3f} ms, torch {ref:.3f} ms "
          f"({ref / fused:.2f}x); largest relative error {rel:.1e}")
    return rel <= 2 ** -6  # two bf16 roundings
