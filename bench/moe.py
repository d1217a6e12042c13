"""The fused MoE kernel (kernels/moe.py) on CUDA: correctness on real shapes, then timings.

One MoE layer of Qwen3-30B-A3B (H 2,048, expert width 768, 8 of 128 experts a token) and
of OLMoE-1B-7B (H 2,048, width 1,024, 8 of 64), bf16, routed by random logits, at
T = 1, 32, 256 (decode batches) and 2,048, 8,192 (prefill steps). Per case: the relative
errors of `moe_triton`, of `moe_reference` (the loop over the experts in use) and of
`moe_grouped` (torch's grouped GEMM, the path transformers takes) against the exact
answer, the median time of each, and for decode steps `moe_triton`
inside a CUDA graph (what the engine replays: the loop reads the routing back to the
host and cannot be captured). Bytes are the used experts' weights read once, against
the 4.1 TB/s copy ceiling; FLOP/s count 6 T k H I.

    PYTHONPATH=<dir holding tokendance/> python bench/moe.py [--smoke]

--smoke runs tiny shapes under TRITON_INTERPRET=1 on the CPU (checks the script only);
--cpu times the CPU's two paths (the loop, the grouped GEMM) on a GraniteMoE-1B layer;
--sweep times the Triton kernel's launch configurations; --align times the grouping
step (`align_triton` against `align_reference`: equal outputs, then host-inclusive wall
time a call, alone and in the layer: eager, a prefill step's cost); --tokens T[,T...]
sets the sizes these time (the default: the five above).
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tokendance.bench.kernel_timing import (COPY_CEILING, graph_ms, median_ms, rel, save_log, say,  # noqa: E402
                                           wall_ms)
import tokendance.kernels.moe as kmoe  # noqa: E402
from tokendance.kernels.moe import GROUPED_MM, moe_grouped, moe_reference, moe_triton  # noqa: E402

CPU = "--cpu" in sys.argv  # the CPU's two paths alone (the loop, the grouped GEMM), timed
DEV = "cpu" if SMOKE or CPU else "cuda"
DTYPE = torch.bfloat16
# name: (H, I, E, k)
SHAPES = {"qwen3-30b-a3b": (64, 32, 16, 4), "olmoe-1b-7b": (64, 48, 8, 2)} if SMOKE else {
    "qwen3-30b-a3b": (2048, 768, 128, 8), "olmoe-1b-7b": (2048, 1024, 64, 8)}
TOKENS = (1, 8, 40) if SMOKE else (1, 32, 256, 2048, 8192)
if "--tokens" in sys.argv:
    try:
        TOKENS = tuple(int(t) for t in sys.argv[sys.argv.index("--tokens") + 1].split(","))
    except (IndexError, ValueError):
        TOKENS = ()
    if not TOKENS or min(TOKENS) < 1:
        sys.exit("--tokens: a comma list of positive token counts, as 1024,4096")
DECODE = 256  # up to this many tokens: a decode batch, timed in a graph too


def inputs(h: int, i: int, e: int, k: int, t: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(t)
    x = torch.randn(t, h, device=DEV, generator=g).to(DTYPE)
    gate_up = (torch.randn(e, 2 * i, h, device=DEV, generator=g) * h ** -0.5).to(DTYPE)
    down = (torch.randn(e, h, i, device=DEV, generator=g) * i ** -0.5).to(DTYPE)
    logits = torch.randn(t, e, device=DEV, generator=g)
    w, ids = logits.softmax(-1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(DTYPE)
    return x, gate_up, down, w, ids


def case(name: str, h: int, i: int, e: int, k: int, t: int) -> tuple[str, bool]:
    x, gate_up, down, w, ids = inputs(h, i, e, k, t)
    # both against the exact answer (float32 from the same bf16 inputs): bf16 rounds each
    # path at different points, so neither is the other's reference
    exact = moe_reference(x.float(), gate_up.float(), down.float(), w.float(), ids)
    err = rel(moe_triton(x, gate_up, down, w, ids), exact)
    err_ref = rel(moe_reference(x, gate_up, down, w, ids), exact)
    # the interpreter rounds to bf16 towards zero (twice the error of a GPU's to nearest)
    ok = err <= (3.0 if SMOKE else 1.5) * err_ref
    used = int(ids.unique().numel())
    t_ref = median_ms(lambda: moe_reference(x, gate_up, down, w, ids), SMOKE)
    t_tri = median_ms(lambda: moe_triton(x, gate_up, down, w, ids), SMOKE)
    t_grp = median_ms(lambda: moe_grouped(x, gate_up, down, w, ids), SMOKE) if GROUPED_MM else float("nan")
    err_grp = rel(moe_grouped(x, gate_up, down, w, ids), exact) if GROUPED_MM else float("nan")
    graph = ""
    if t <= DECODE:
        t_g = graph_ms(lambda: moe_triton(x, gate_up, down, w, ids), SMOKE, launches=8)
        graph = f"{t_g:.3f}"
    else:
        t_g = t_tri
    bytes_ = used * 3 * h * i * x.element_size()
    flops = 6 * t * k * h * i
    best = min(t_tri, t_g)
    sec = best * 1e-3
    row = (f"| {name} | {t} | {used} | {err:.1e} / {err_ref:.1e} / {err_grp:.1e} | {t_ref:.3f} | {t_grp:.3f} | "
           f"{t_tri:.3f} | {graph or '-'} | {t_ref / best:.2f}x | {t_grp / best:.2f}x | "
           f"{bytes_ / sec / 1e9:,.0f} GB/s ({bytes_ / sec / COPY_CEILING:.0%}) | "
           f"{flops / sec / 1e12:,.1f} TFLOP/s |")
    return row, ok


def main() -> int:
    say(f"fused MoE (kernels/moe.py) vs the reference loop, {DTYPE}, on {DEV}"
        + (f" ({torch.cuda.get_device_name()})" if DEV == "cuda" else " (interpreter)"))
    say("| shape | T | experts used | rel err fused / loop / grouped | loop ms | grouped ms | fused ms | "
        "fused in a graph ms | fused vs loop | fused vs grouped | weights read | compute |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name, (h, i, e, k) in SHAPES.items():
        for t in TOKENS:
            row, good = case(name, h, i, e, k, t)
            ok &= good
            say(row)
    say("all ok" if ok else "MISMATCH")
    save_log("moe.txt")
    return 0 if ok else 1


def cpu_main() -> int:
    """One layer of the GraniteMoE-1B shape (H 1,024, width 512, 8 of 32 experts) on this
    CPU: the reference loop against torch's grouped GEMM, medians of 30 calls."""
    def ms(fn) -> float:
        return wall_ms(fn, False, calls=1, repeats=30)

    say(f"MoE layer (granitemoe-1b), {DTYPE}, on this CPU ({torch.get_num_threads()} threads): loop vs grouped")
    say("| tokens | rel err loop / grouped | loop ms | grouped ms | grouped vs loop |\n|---|---|---|---|---|")
    for t in (1, 8, 64, 512):
        args = inputs(1024, 512, 32, 8, t)
        exact = moe_reference(*(a.float() if a.is_floating_point() else a for a in args))
        e_ref, e_grp = rel(moe_reference(*args), exact), rel(moe_grouped(*args), exact)
        a, b = ms(lambda: moe_reference(*args)), ms(lambda: moe_grouped(*args))
        say(f"| {t} | {e_ref:.1e} / {e_grp:.1e} | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    return 0


SWEEP = [dict(block_m=m, block_n=n, block_k=bk, num_warps=w, num_stages=st)
         for m, n, bk, w, st in ((64, 64, 64, 4, 3), (16, 64, 128, 4, 3), (16, 64, 64, 4, 4), (16, 128, 64, 4, 3),
                                 (32, 64, 64, 4, 4), (32, 128, 64, 4, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3),
                                 (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                                 (128, 128, 32, 8, 4))]


def sweep() -> int:
    """The Triton kernel's launch configurations on both layers (`--sweep`): decode batches
    (T <= DECODE) timed inside a CUDA graph, as the engine replays them (eager, the host's
    launches would hide the kernels), prefill steps eager; torch's grouped GEMM eager."""
    for name, (h, i, e, k) in SHAPES.items():
        say(f"{name}: ms per call\n| T | " + " | ".join(
            f"{c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']}" for c in SWEEP)
            + " | grouped |\n|---|" + "---|" * (len(SWEEP) + 1))
        for t in TOKENS:
            args = inputs(h, i, e, k, t)
            timer = (lambda f: graph_ms(f, SMOKE, launches=8)) if t <= DECODE else (lambda f: median_ms(f, SMOKE))
            times = [timer(lambda c=c: moe_triton(*args, cfg=c)) for c in SWEEP]
            grp = median_ms(lambda: moe_grouped(*args), SMOKE) if GROUPED_MM else float("nan")
            say(f"| {t} | " + " | ".join(f"{x:.3f}" for x in times) + f" | {grp:.3f} |")
    save_log("moe_sweep.txt")
    return 0


def align_main() -> int:
    """`--align`: the grouping step in a sort and two launches against the torch ops."""
    h, i, e, k = SHAPES["qwen3-30b-a3b"]
    say(f"align on {DEV}, Qwen3-30B-A3B's layer ({e} experts, {k} a token): ms a call, wall, host included")
    say("| T | outputs equal | align: torch ops | align: Triton | layer: torch ops | layer: Triton | layer |\n"
        "|---|---|---|---|---|---|---|")
    ok, dispatch = True, kmoe.align
    for t in TOKENS:
        x, gate_up, down, w, ids = inputs(h, i, e, k, t)
        bm = kmoe.launch(t)["block_m"] if DEV == "cuda" else kmoe.INTERP_CFG["block_m"]
        a, b = kmoe.align_reference(ids, e, bm), kmoe.align_triton(ids, e, bm)
        same = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        ok &= same
        times = []
        for fn in (kmoe.align_reference, kmoe.align_triton):
            kmoe.align = fn  # what moe_triton calls
            times += [wall_ms(lambda: fn(ids, e, bm), SMOKE),
                      wall_ms(lambda: moe_triton(x, gate_up, down, w, ids), SMOKE)]
        kmoe.align = dispatch
        say(f"| {t} | {same} | {times[0]:.3f} | {times[2]:.3f} | {times[1]:.3f} | {times[3]:.3f} | "
            f"{times[1] / times[3]:.2f}x |")
    say("all ok" if ok else "MISMATCH")
    save_log("moe_align.txt")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(cpu_main() if CPU else sweep() if "--sweep" in sys.argv else align_main() if "--align" in sys.argv
             else main())
