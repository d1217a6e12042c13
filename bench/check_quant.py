"""CUDA checks of 8-bit weights (`--quantization fp8`, kernels/fp8_linear.py) that CPU tests
cannot make: the rows' rounding kernel against torch's bit for bit (Triton's interpreter
rounds some ties otherwise); the layer on FP8 tensor cores (the few-rows kernel up to 16
rows, `torch._scaled_mm` past them) against the float32 reference at Qwen2.5-7B's widths
and decode to prefill row counts; and in a bf16 engine of that shape (four layers, random
weights): its scores through the tensor cores against the same engine through the
reference, and CUDA-graph decode against eager over its fp8 layers. Run on the GPU machine:
python -m tokendance.bench.check_quant"""

from __future__ import annotations

import sys

import torch
from torch import nn

from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.bench.check_cuda import graphs_vs_eager, vocab
from tokendance.bench.engine import rand_prompts
from tokendance.bench.kernel_timing import rel
from tokendance.bench.small import small_folder
from tokendance.kernels import fp8_linear as fl
from tokendance.kernels import fp8_triton as ft


def rounding() -> bool:
    """The rows kernel's bytes and scales against torch's, bf16 and float32 rows of every
    magnitude (and one of zeros) at the layers' input widths, each row under its own scale
    and under a static one (saturating most rows)."""
    torch.manual_seed(1)
    same = True
    for k in (3584, 18944, 1500):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(64, k, device="cuda") * torch.logspace(-4, 4, 64, device="cuda")[:, None]).to(dtype)
            x[5] = 0
            for fixed in (None, torch.tensor(0.01, device="cuda")):  # per row, and a checkpoint's static scale
                q, s = ft.quantize_rows_triton(x, fixed)
                want_q, want_s = fl.quantize_rows(x, fixed)
                same &= torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    return same


def layers() -> float:
    """The largest relative error of the tensor cores' product against the reference."""
    torch.manual_seed(0)
    worst = 0.0
    for k, n in ((3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584)):  # qkv, o, gate_up, down
        f = fl.Fp8Linear.of(nn.Linear(k, n, bias=n == 4608, device="cuda", dtype=torch.bfloat16))
        for rows in (1, 7, 16, 17, 300, 4096):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            for fixed in (None, torch.tensor(0.02, device="cuda")):  # inputs per row, and under a static scale
                f.input_scale = fixed
                want = fl.fp8_linear_reference(x.float(), f.weight, f.scale, None if f.bias is None else f.bias.float(),
                                               fixed)
                worst = max(worst, rel(f(x), want))
    return worst


def scores(eng: Engine, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's logprob of its own next tokens (teacher-forced), concatenated."""
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for i, p in enumerate(prompts):
        eng.add(f"s{i}", p, sp)
    got: dict[str, list[float]] = {}
    while eng.has_work():
        for rid, d in eng.step():
            if d.prompt_logprobs is not None:
                got[rid] = [t.logprob for t in d.prompt_logprobs[1:]]
    return torch.tensor([x for rid in sorted(got) for x in got[rid]])


def engine_paths() -> tuple[float, float]:
    """A bf16 engine's prompt scores through the tensor cores against the reference's: the
    mean and the largest difference."""
    shape = "qwen2.5-7b"
    eng = Engine(EngineConfig(model=str(small_folder(shape=shape)), dtype="bfloat16", random_weights=True,
                              quantization="fp8", kv_tokens=16384))
    prompts = rand_prompts(4, 200, vocab(shape), 3)
    fast = scores(eng, prompts)
    eng.reset_caches()
    saved, fl.fast = fl.fast, lambda x: False
    try:
        slow = scores(eng, prompts)
    finally:
        fl.fast = saved
    d = (fast - slow).abs()
    return float(d.mean()), float(d.max())


def main() -> int:
    same = rounding()
    print(f"fp8 weights, the rows' rounding kernel = torch's, bytes and scales, per row and static: {same}")
    err = layers()
    print(f"fp8 weights, tensor cores against the reference at Qwen2.5-7B's widths, 1 to 4,096 rows, "
          f"inputs per row and under a static scale: "
          f"relative error at most {err:.2e}")
    ok = same and err < 2e-2
    mean, top = engine_paths()
    print(f"fp8 weights in a bf16 engine (Qwen2.5-7B shape, 4 layers): prompt logprobs through the tensor "
          f"cores against the reference, differences {mean:.4f} on average, {top:.3f} at most")
    ok &= mean < 0.02 and top < 0.25
    g = graphs_vs_eager(quantization="fp8")
    print(f"CUDA-graph decode vs eager over fp8 layers, bf16: relative error {g:.2e}")
    return 0 if ok and g < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
