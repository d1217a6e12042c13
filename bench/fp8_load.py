"""Loading 8-bit weights: the memory a load peaks at, and its time, four ways over one model.

- `wide`: the checkpoint as it is (the baseline);
- `after`: `--quantization fp8` as session 63 did it, the wide model built and loaded, then
  its projections rounded (`fp8_linear.quantize`);
- `rounded`: `--quantization fp8` now, each row rounded as it is read (backend/place.py);
- `stored`: the checkpoint `tokendance quantize` writes, its e4m3 bytes placed as they are.

Each load runs in a fresh process, weights only (no KV pool): the peak is CUDA's
max_memory_allocated on a GPU, else the largest anonymous resident memory sampled every
2 ms beyond what the process held before (the checkpoint's mapped file pages are the page
cache's, not the load's; what glibc keeps of freed memory counts); held is the model's
tensors' bytes. `rounded` and `stored` must hold the same bytes: a fingerprint
of their projections is compared.

With `--baseline DIR` (an earlier checkout's repository root) every way is also loaded by
that code, in the same alternation, and the table gives each way's time against it.

python -m tokendance.bench.fp8_load --model qwen2.5-7b --dtype bfloat16 (a shape: random bf16
weights saved first) or --model default --dtype float32 (the embedded SmolLM2)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from tokendance.backend import loader
from tokendance.backend.checkpoint import write
from tokendance.backend.config import ModelConfig
from tokendance.backend.quant import Quant
from tokendance.bench.shapes import SHAPES, save_random
from tokendance.kernels import fp8_linear

WAYS = ("wide", "after", "rounded", "stored")


def anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


def one(way: str, folder: Path, dtype: torch.dtype, device: torch.device) -> dict:
    """Load once: seconds, the peak, the model's tensors (MiB), the projections' fingerprint."""
    cfg = ModelConfig.load(folder)
    if way == "rounded":
        cfg = replace(cfg, quant=Quant("fp8", False))
    peak, done = [anon_kib()], threading.Event()
    base = peak[0]

    def sample() -> None:
        while not done.wait(0.002):
            peak.append(anon_kib())

    watch = threading.Thread(target=sample, daemon=True)
    watch.start()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = loader.load(folder, cfg, dtype, device)
    if way == "after":
        fp8_linear.quantize(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    done.set()
    watch.join()
    top = torch.cuda.max_memory_allocated() if device.type == "cuda" else (max(peak) - base) << 10
    tensors = {t.untyped_storage().data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    held = sum(t.untyped_storage().nbytes() for t in tensors.values())
    h = hashlib.sha1()
    for name, b in sorted(model.named_buffers()):
        if b.dtype == fp8_linear.E4M3 or name.endswith(".scale"):
            h.update(b.view(torch.uint8).cpu().numpy().tobytes() if b.dtype == fp8_linear.E4M3
                     else b.cpu().numpy().tobytes())
    return {"seconds": seconds, "peak_mib": top / 2**20, "held_mib": held / 2**20, "print": h.hexdigest()[:12]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="a shape name (random bf16 weights saved), a folder, "
                                                      "or default (the embedded SmolLM2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="where the checkpoints are written (default: the cache)")
    p.add_argument("--baseline", default=None, help="an earlier checkout's root: each way loaded by it too")
    p.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args()
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = getattr(torch, args.dtype)
    if args.one:
        print(json.dumps(one(args.one, Path(args.folder), dtype, device)))
        return
    work = Path(args.work) if args.work else loader.cache_dir() / "fp8_load"
    if args.model in SHAPES:
        wide = work / f"{args.model}-bf16"
        if not (wide / "config.json").exists():
            start = time.perf_counter()
            save_random(args.model, wide)
            print(f"random bf16 checkpoint written: {time.perf_counter() - start:.1f} s")
    else:
        wide = loader.resolve(args.model)
    stored = work / f"{wide.name}-fp8"
    if not (stored / "config.json").exists():
        start = time.perf_counter()
        wrote = write(wide, stored)
        print(f"tokendance quantize: {wrote['projections']} projections, {wrote['wide_bytes'] / 2**20:,.1f} -> "
              f"{wrote['bytes'] / 2**20:,.1f} MiB on disk, {time.perf_counter() - start:.1f} s")
    codes = {"": None} if args.baseline is None else {"": None, "@base": shim(Path(args.baseline))}
    runs: dict[str, list[dict]] = {w + c: [] for c in codes for w in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:  # alternating: a slow minute of the machine falls on every way
            for code, path in codes.items():
                cmd = [sys.executable, "-m", "tokendance.bench.fp8_load", "--one", way, "--dtype", args.dtype,
                       "--device", str(device), "--folder", str(stored if way == "stored" else wide)]
                env = None if path is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [path, os.environ.get("PYTHONPATH", "")])}
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
                runs[way + code].append(json.loads(out.strip().splitlines()[-1]))
                print(way + code, runs[way + code][-1], flush=True)  # what a cut-short run still shows
    med = {k: {f: statistics.median(r[f] for r in rs) for f in ("seconds", "peak_mib", "held_mib")}
           for k, rs in runs.items()}
    print(f"\n{wide.name}, {args.dtype} on {device}, medians of {args.repeats} fresh processes")
    print(f"{'way':<13} {'seconds':>8} {'peak MiB':>10} {'held MiB':>10} {'peak / wide':>11}"
          f"{'  s / base' if args.baseline else ''}  projections")
    for way, rs in runs.items():
        m, vs = med[way], ""
        if args.baseline:  # each way's time against the earlier code's
            vs = " " * 10 if way.endswith("@base") else f"{m['seconds'] / med[way + '@base']['seconds']:>9.2f}x"
        print(f"{way:<13} {m['seconds']:>8.2f} {m['peak_mib']:>10,.1f} {m['held_mib']:>10,.1f} "
              f"{m['peak_mib'] / med['wide']['peak_mib']:>10.2f}x{vs}  {','.join({r['print'] for r in rs})}")
    same = {r["print"] for r in runs["rounded"] + runs["stored"]}
    print(f"rounded = stored, byte for byte: {len(same) == 1}")


def shim(root: Path) -> str:
    """A folder whose `tokendance` package is the checkout at `root` (its folders, as
    setuptools maps them): put first on a child's PYTHONPATH."""
    top = Path(tempfile.mkdtemp(prefix="td-base-")) / "tokendance"
    top.mkdir()
    for d in ("backend", "kernels", "proxy", "adapters", "bench", "examples"):
        if (root / d).is_dir():
            (top / d).symlink_to((root / d).resolve())
    return str(top.parent)


if __name__ == "__main__":
    main()
