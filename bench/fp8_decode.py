"""Where an 8-bit pool's paged decode loses its time (docs/benchmarks.md, session 62: over
e4m3 the kernel read half a bf16 pool's bytes in 37 % more time, with 141 registers a
thread against 104, until the launcher capped them at 128). Qwen2.5-7B attention (Hq=28,
Hkv=4, D=128, B=16), 32 x 4,096 decode, bf16 rows, over a bf16 pool and the same values
in e4m3. Each variant's kernels are loaded as a package of their own from a patched copy
of kernels/ (bench/ptx.py `load_baseline`):

- current: this checkout's kernels;
- f16 rotation: 8-bit keys widened to float16 and rotated in it (not float32);
- launch options of the current kernels over e4m3: registers uncapped (the launcher caps
  them at 128 over an 8-bit pool, paged_triton.decode_cap) or at 96, keys of 16;
- no V / no K (timing only, their results are wrong): values or keys never read, to see
  what each side of an 8-bit tile costs;
- other decode launches, each over bf16, over e4m3 as launched (capped, decode_cap) and
  over e4m3 uncapped: a Mirror's slot positions (the keys' positions read from a table, as
  Mirrors' patched slots are) and a sliding window of 1,024.

    PYTHONPATH=<dir holding tokendance/> python bench/fp8_decode.py [--smoke]

--smoke runs tiny shapes under TRITON_INTERPRET=1 on the CPU (checks the script only).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tokendance.bench.kernel_timing import median_ms, rel, say, summary  # noqa: E402
from tokendance.bench.ptx import load_baseline  # noqa: E402
from tokendance.kernels import paged_attention as pa  # noqa: E402
from tokendance.kernels.fp8 import FP8, narrow  # noqa: E402
from tokendance.kernels.tiles import trig_table  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
DEV = "cpu" if SMOKE else "cuda"
KEYS = """        k1 = tl.load(kp).to(tl.float32)
        k2 = tl.load(kp + HALF).to(tl.float32)"""
ROTATE = """    r1 = (k1 * c - k2 * s).to(q1.dtype)
    r2 = (k2 * c + k1 * s).to(q1.dtype)"""
VALUES = "    v = _values(vp, jm, q1.dtype, MASK)\n"
PATCHES: dict[str, list[tuple[str, str, str]]] = {
    "current": [],
    "f16 rotation": [("tiles.py", KEYS, KEYS.replace("tl.float32", "tl.float16")),
                     ("tiles.py", ROTATE, "    c16 = c.to(tl.float16)\n    s16 = s.to(tl.float16)\n"
                      + ROTATE.replace("* c", "* c16").replace("* s", "* s16"))],
    "no V": [("tiles.py", VALUES, "    v = tl.zeros([j.shape[0], 2 * HP], dtype=tl.float16)\n")],
    "no K": [("tiles.py", KEYS, "        k1 = tl.zeros([HP, j.shape[0]], dtype=tl.float32)\n"
                                "        k2 = tl.zeros([HP, j.shape[0]], dtype=tl.float32)")],
}
LAUNCHES = [dict(maxnreg=None), dict(maxnreg=96), dict(block_n=16)]  # None: uncapped
CASES = ("slot positions", "window 1024")


def variant(name: str) -> object:
    """The paged_triton module of a copy of kernels/ with `name`'s patches (each must
    match once: a kernel change that moves them fails here, not silently)."""
    folder = Path(tempfile.mkdtemp())
    for f in KERNELS.glob("*.py"):
        shutil.copy(f, folder / f.name)
    for file, old, new in PATCHES[name]:
        src = (folder / file).read_text()
        if src.count(old) != 1:
            raise SystemExit(f"variant {name!r}: its patch of {file} no longer matches the kernels")
        (folder / file).write_text(src.replace(old, new))
    return load_baseline(str(folder), "fp8v_" + "".join(ch for ch in name if ch.isalnum()))("paged_triton")


def inputs(S: int, L: int, hq: int = 28, hkv: int = 4, d: int = 128, b: int = 16) -> tuple:
    g = torch.Generator(device=DEV).manual_seed(0)
    blocks = S * L // b
    kc = torch.randn(blocks + 8, b, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(blocks + 8, b, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    tables = torch.randperm(blocks + 8, device=DEV, generator=g)[:blocks].view(S, -1).int()
    q = torch.randn(S, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    return (q, torch.full((S,), L - 1, device=DEV), torch.arange(S + 1, device=DEV, dtype=torch.int32), kc, vc,
            tables, torch.full((S,), L, device=DEV, dtype=torch.int32), inv, 1.0, d ** -0.5)


def case_args(case: str, S: int, L: int) -> dict:
    """The keyword arguments of a decode launch of `case` (keys at their own positions:
    a Mirror's table, here each slot's own index, read rather than implied)."""
    if case == "slot positions":
        return dict(slot_pos=torch.arange(L, device=DEV, dtype=torch.int32).expand(S, L).contiguous())
    if case == "window 1024":
        return dict(window=min(1024, L // 2))
    return {}


def compiled(pt) -> dict:
    """The decode kernel's compiled variants so far, by their key (none under the interpreter)."""
    caches = getattr(pt._decode_kernel, "device_caches", {})
    return {(dev, key): k for dev, cache in caches.items() for key, k in cache[0].items()}


def main() -> int:
    S, L = (2, 64) if SMOKE else (32, 4096)
    bf16 = inputs(S, L)
    pools = {"bf16": bf16, "e4m3": (*bf16[:3], narrow(bf16[3], FP8["fp8"]), narrow(bf16[4], FP8["fp8"]),
                                    *bf16[5:])}
    trig = trig_table(bf16[7], L + 64)
    rows = [(name, pool, {}, variant(name), "") for name in PATCHES for pool in ("bf16", "e4m3")]
    current = rows[0][3]
    rows += [("current", "e4m3", cfg, current, "") for cfg in LAUNCHES]
    rows += [("current", pool, cfg, current, case) for case in CASES
             for pool, cfg in (("bf16", {}), ("e4m3", {}), ("e4m3", dict(maxnreg=None)))]
    say(f"decode {S} x {L}, Qwen2.5-7B attention, bf16 rows; {torch.cuda.get_device_name() if not SMOKE else 'cpu'}")
    times: list[list[float]] = [[] for _ in rows]
    ok, errors, regs, runs = True, [], [], []
    for i, (name, pool, cfg, pt, case) in enumerate(rows):  # compile and check each, then time
        args, extra = pools[pool], case_args(case, S, L)
        out = torch.empty_like(args[0])

        def run(pt=pt, args=args, out=out, cfg=cfg, extra=extra):
            return pt.paged_attention_triton(*args, out=out, max_q=1, trig=trig, cfg=cfg, **extra)

        before = compiled(pt)
        run()
        new = [k for key, k in compiled(pt).items() if key not in before]
        regs.append(", ".join(f"{k.n_regs}/{k.n_spills}" for k in new) or "-")
        wide = tuple(t.double() if torch.is_tensor(t) and t.is_floating_point() else t for t in args)
        errors.append(rel(out, pa.paged_attention_reference(*wide, **extra)))
        ok &= name.startswith("no ") or errors[i] < 2e-2
        runs.append(run)
    for _ in range(1 if SMOKE else 3):  # alternating: each variant once a pass
        for i, run in enumerate(runs):
            times[i].append(median_ms(run, SMOKE))
    base = {case: statistics.median(times[i]) for i, (name, pool, cfg, _, case) in enumerate(rows)
            if name == "current" and pool == "bf16" and not cfg}
    out = ["| variant | decode | pool | launch | registers/spills | us (median of 3) | vs bf16 current | rel err |",
           "|---|---|---|---|---|---|---|---|"]
    for i, (name, pool, cfg, pt, case) in enumerate(rows):
        ms, b = statistics.median(times[i]), base[case]
        note = " (not a result)" if name.startswith("no ") else ""
        out.append(f"| {name} | {case or 'plain'} | {pool} | {cfg or ''} | {regs[i]} | {ms * 1e3:.1f} | "
                   f"{ms / b if b else 0:.2f}x | {errors[i]:.1e}{note} |")
    return summary("bench_fp8_decode.log", ok, out)


if __name__ == "__main__":
    sys.exit(main())
