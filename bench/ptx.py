"""The Triton kernels compiled for a GPU on a machine without one, their arguments
specialized as Triton's launcher specializes them at run time: each kernel's PTX,
ptxas's registers and spills, its global loads by width and its byte-wide loads from shared
memory at the head dims asked, over a pool of bf16 or (--pool) 8-bit floats, and,
with --baseline (an earlier checkout's kernels folder, or a git revision of this one),
whether this checkout's PTX is the same as that one's (its instructions: the parameters
declared may differ).

What a kernel change does to the code a GPU runs, seen where no GPU is lent: a change
meant to leave a head dim's code alone must leave its PTX identical.

    python -m tokendance.bench.ptx [--baseline DIR|REV] [--dims 64,128] [--arch 90] [--kernels NAME,...]
                                   [--pool fp8|fp8_e4m3|fp8_e5m2]

It exits 1 when a kernel's PTX differs from the baseline's. Triton's interpreter
(TRITON_INTERPRET=1) compiles nothing: run it without.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tokendance.kernels.fp8 import FP8, limit
from tokendance.kernels.jit import padded_half

# Argument types by parameter name (the rest are i32 scalars); every kernel's names agree.
TYPES = {
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "x": "*bf16", "kc": "*bf16", "vc": "*bf16", "kr": "*bf16",
    "out": "*bf16", "qo": "*bf16", "q_pos": "*i64", "pos": "*i64", "slots": "*i64", "cu_q": "*i32",
    "bt": "*i32", "kpt": "*i32", "kv_lens": "*i32", "chunks": "*i32", "shift": "*i32", "table": "*i32",
    "hide": "*u8", "inv_freq": "*fp32", "trig": "*fp32", "o_part": "*fp32", "lse_part": "*fp32",
    "lse_out": "*fp32", "qk_scale": "fp32", "scale": "fp32", "cap": "fp32",
}


@dataclass(frozen=True)
class Kernel:
    module: str  # under kernels/
    name: str
    warps: int = 4
    stages: int = 2
    extra: tuple = ()  # constexprs besides the head's, as (name, value) pairs

    def constexprs(self, d: int, fn) -> dict:
        head = dict(HALF=d // 2, HP=padded_half(d), D=d, DP=2 * padded_half(d))
        return {k: v for k, v in (*head.items(), *self.extra) if k in fn.arg_names}


# The launch configurations the engine uses on a GPU (kernels/paged_triton.py, collective_triton.py),
# bf16, seven query heads a kv head (Qwen2.5-7B's).
KERNELS = [
    Kernel("paged_triton", "_decode_kernel", extra=(("G", 7), ("B", 16), ("BLOCK_M", 16), ("BLOCK_N", 32),
                                                    ("NSPLIT", 8), ("STEP", 2), ("POS", False), ("WIN", False),
                                                    ("CAP", False), ("TRIG", True), ("PREC", "tf32"))),
    Kernel("paged_triton", "_prefill_kernel", 8, 2, (("G", 7), ("B", 16), ("BLOCK_M", 128), ("BLOCK_N", 64),
                                                    ("STEP", 1), ("POS", False), ("WIN", False), ("CAP", False),
                                                    ("TRIG", False), ("PREC", "tf32"))),
    Kernel("paged_triton", "_reduce_kernel", extra=(("BLOCK", 32),)),
    Kernel("collective_triton", "_rotate_kernel", extra=(("B", 16), ("BLOCK_N", 32))),
    Kernel("collective_triton", "_collective_kernel", extra=(("G", 7), ("B", 16), ("BLOCK_M", 16), ("BLOCK_N", 64),
                                                      ("WIN", False), ("CAP", False), ("PREC", "tf32"))),
    Kernel("collective_triton", "_merge_kernel", extra=(("NSPLIT", 8),)),
    Kernel("rope", "_rope_kernel", extra=(("BLOCK_H", 32),)),
    Kernel("store", "_store_kernel", extra=(("BLOCK_Q", 32), ("BLOCK_KV", 4), ("ROTATE", True), ("FP8", False),
                                            ("LIM", 0.0))),
]


ROOT = Path(__file__).resolve().parents[1]  # the checkout: bench/ beside kernels/


def ints(d: int, hq: int = 28, hkv: int = 4, b: int = 16) -> dict[str, int]:
    """The integer arguments whose values the layout fixes, as the engine passes them at
    head dim d (Qwen2.5-7B's heads, 16-slot blocks). Triton's launcher marks each one
    divisible by 16 as such (and every 16-byte aligned pointer), and the loads' widths
    follow from it: so must the PTX compiled here. Counts the batch sets are left out."""
    hp2 = 2 * padded_half(d)
    return dict(s_qt=hq * d, s_qh=d, s_kt=hkv * d, s_kh=d, s_vt=hkv * d, s_vh=d, s_ot=hq * d,
                s_oh=d, sxt=hq * d, sxh=d, sot=hq * d, soh=d, s_blk=b * hkv * d, s_slot=hkv * d,
                s_ch=d, s_rj=hkv * hp2, s_rh=hp2, s_bt=256, s_sp=b * 256, trig_n=32768, Hq=hq,
                Hkv=hkv, H=hq)


def attrs(fn, d: int) -> dict:
    """Triton's specialization of fn's arguments at head dim d: pointers (the pool's and
    torch's tensors are 16-byte aligned) and the integers of `ints` divisible by 16."""
    vals = ints(d)
    return {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
            if TYPES.get(n, "i32").startswith("*") or vals.get(n, 1) % 16 == 0}


def widths(ptx: str) -> dict[int, int]:
    """Global loads by bytes an instruction (plain and cp.async): a head's row read 2 bytes
    at a time is what an unaligned stride costs."""
    out: dict[int, int] = {}
    for m in re.finditer(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", ptx):
        n = int(m.group(1), 0)
        out[n] = out.get(n, 0) + 1
    for m in re.finditer(r"ld\.global\S*?(?:\.v(\d))?\.[bfsu](\d+) ", ptx):
        n = int(m.group(1) or 1) * int(m.group(2)) // 8
        out[n] = out.get(n, 0) + 1
    return dict(sorted(out.items(), reverse=True))


def from_git(rev: str) -> str:
    """The kernels folder of revision `rev` of this checkout, written out to a new folder;
    ValueError when git does not know it."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise ValueError(f"git cannot read {rev!r}: {out.stderr.strip()}")
        return out.stdout

    folder = Path(tempfile.mkdtemp())
    for path in git("ls-tree", "--name-only", f"{rev}:kernels").split():
        if path.endswith(".py"):
            folder.joinpath(path).write_text(git("show", f"{rev}:kernels/{path}"))
    return str(folder)


def resolve(baseline: str) -> str:
    """`--baseline`: an earlier checkout's kernels folder, or a git revision of this
    checkout (its kernels written out by `from_git`); ValueError, in a line, for neither."""
    if Path(baseline).is_dir():
        if not Path(baseline, "paged_triton.py").is_file():
            raise ValueError(f"{baseline} is not a kernels folder: it holds no paged_triton.py")
        return baseline
    try:
        return from_git(baseline)
    except (OSError, ValueError) as exc:
        raise ValueError(f"not a folder, and {exc}") from None


def load_baseline(folder: str, package: str = "tdbase"):
    """An earlier checkout's kernels folder as the package `<package>.kernels` (its imports
    of tokendance.kernels rewritten), to compile or time beside this checkout's."""
    root = Path(tempfile.mkdtemp())
    pkg = root / package / "kernels"
    pkg.mkdir(parents=True)
    (root / package / "__init__.py").write_text("")
    for f in Path(folder).glob("*.py"):
        pkg.joinpath(f.name).write_text(f.read_text().replace("tokendance.kernels", f"{package}.kernels"))
    sys.path.insert(0, str(root))
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]  # an earlier baseline's
    importlib.invalidate_caches()
    return lambda module: importlib.import_module(f"{package}.kernels.{module}")


POOL_TYPES = {torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


def pooled(consts: dict, pool: str | None) -> dict:
    """A kernel's constexprs over a pool of `pool` (None: bf16, the pool in the rows' dtype):
    the store kernel's saturation follows it."""
    if pool is None or "FP8" not in consts:
        return consts
    return {**consts, "FP8": True, "LIM": limit(FP8[pool])}


def compile_ptx(fn, d: int, consts: dict, warps: int, stages: int, arch: int, pool: str | None = None) -> str:
    """fn's PTX for sm_<arch> at head dim d (K/V in a pool of `pool`, see `pooled`; the
    decode kernel over an 8-bit pool capped at the launcher's registers), its debug sections
    and comments dropped."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = TYPES if pool is None else {**TYPES, "kc": POOL_TYPES[FP8[pool]], "vc": POOL_TYPES[FP8[pool]]}
    consts = pooled(consts, pool)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    options = dict(num_warps=warps, num_stages=stages)
    if pool is not None and fn.__name__ == "_decode_kernel":
        from tokendance.kernels.paged_triton import decode_cap

        options.update(decode_cap(FP8[pool], d, consts.get("CAP", False)))
    k = triton.compile(ASTSource(fn, sig, consts, attrs(fn, d)), target=GPUTarget("cuda", arch, 32),
                       options=options)
    text = re.split(r"\.section\s+\.debug", k.asm["ptx"])[0]
    # debug labels too: an inlined helper adds some, and nothing but the dropped sections jumps to them
    drop = r"//.*|^\s*\.(loc|file)\b.*|^\$L__tmp\d+:$"
    lines = (re.sub(drop, "", line).rstrip() for line in text.splitlines())
    return "\n".join(line for line in lines if line.strip())


def registers(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill bytes stored) that ptxas reports for the PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([getattr(tool, "path", tool), "-v", f"--gpu-name=sm_{arch}a", f.name,
                              "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores", out)
    return int(regs.group(1)) if regs else 0, int(spills.group(1)) if spills else 0


def _code(ptx: str) -> list[str]:
    """The PTX less its parameter declarations: an argument that a constexpr leaves unread
    (a sliding window's size, where there is none) adds one and changes no instruction."""
    return [line for line in ptx.splitlines() if not line.lstrip().startswith(".param")]


def gathers(ptx: str) -> int:
    """Loads of a single byte from shared memory: what an 8-bit operand whose layout no
    ldmatrix serves costs."""
    return len(re.findall(r"^\s*ld\.shared\.[bsu]8\b", ptx, re.M))


def compare(dims: list[int], arch: int, baseline: str | None, kernels=KERNELS, pool: str | None = None) -> list[tuple]:
    """Rows (kernel, head dim, PTX lines, registers, spill bytes, `widths`, `gathers`, the
    baseline's (registers, spill bytes, gathers) and whether its PTX is the same, or None
    and None), K/V in a pool of `pool` (`pooled`)."""
    old = load_baseline(baseline) if baseline else None
    rows = []
    for kern in kernels:
        fn = getattr(importlib.import_module(f"tokendance.kernels.{kern.module}"), kern.name)
        for d in dims:
            ptx = compile_ptx(fn, d, kern.constexprs(d, fn), kern.warps, kern.stages, arch, pool)
            same = then = None
            if old is not None:
                base = getattr(old(kern.module), kern.name)
                was = compile_ptx(base, d, kern.constexprs(d, base), kern.warps, kern.stages, arch, pool)
                same, then = _code(ptx) == _code(was), (*registers(was, arch), gathers(was))
            rows.append((kern.name, d, len(ptx.splitlines()), *registers(ptx, arch), widths(ptx), gathers(ptx),
                         then, same))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="an earlier checkout's kernels folder, or a git revision of this "
                                      "checkout, to compare PTX with")
    p.add_argument("--dims", default="64,128", help="head dims, comma-separated")
    p.add_argument("--arch", type=int, default=90, help="the GPU's compute capability, as 90")
    p.add_argument("--kernels", help="only these kernels, comma-separated (default: all)")
    p.add_argument("--pool", choices=tuple(FP8), help="K/V in 8-bit floats (--kv-cache-dtype's names; default bf16)")
    a = p.parse_args()
    try:
        dims = [int(x) for x in a.dims.split(",")]
    except ValueError:
        print(f"--dims: not a list of integers: {a.dims!r}", file=sys.stderr)
        return 2
    label = a.baseline
    if a.baseline:
        try:
            a.baseline = resolve(a.baseline)
        except ValueError as exc:
            print(f"--baseline: {exc}", file=sys.stderr)
            return 2
    names = a.kernels.split(",") if a.kernels else [k.name for k in KERNELS]
    unknown = sorted(set(names) - {k.name for k in KERNELS})
    if unknown:
        print(f"--kernels: unknown {', '.join(unknown)}; choose of {', '.join(k.name for k in KERNELS)}",
              file=sys.stderr)
        return 2
    rows = compare(dims, a.arch, a.baseline, [k for k in KERNELS if k.name in names], a.pool)
    print(f"sm_{a.arch}, Triton kernels as the engine launches them, K/V in {a.pool or 'bf16'}" +
          (f"; PTX against {label}" if a.baseline else ""))
    print("| kernel | head dim | PTX lines | registers | spill bytes | global loads (bytes: count) | "
          "byte loads from shared |" + (" the baseline's registers, spill bytes, byte loads | same PTX |"
                                        if a.baseline else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if a.baseline else ""))
    for name, d, n, regs, spill, w, g, then, same in rows:
        loads = ", ".join(f"{b}: {c}" for b, c in w.items())
        print(f"| {name} | {d} | {n:,} | {regs} | {spill} | {loads} | {g} |"
              + (f" {', '.join(map(str, then))} | {same} |" if same is not None else ""))
    return 0 if all(r[-1] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
