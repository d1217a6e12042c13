"""A GGUF's conversion into an HF folder (backend/convert.py): this tree's against a
baseline revision's, each conversion in a process of its own, alternating, its wall time
and its peak resident memory (VmHWM). Two files: the embedded SmolLM2-135M-Instruct
(Q4_1), and a synthetic Llama (Q8_0, random weights, SmolLM2's tokenizer) of --layers x
--hidden, big enough that holding the model in float32 shows.

    python bench/convert.py --baseline 1e8e0f9 [--repeats 3] [--layers 12 --hidden 2048]

The folders each writes are compared file by file (SHA-1) against the baseline's, the
weights by their names and values.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import importlib.util, json, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("convert_under_test", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
t = time.perf_counter()
mod.convert_gguf(Path(sys.argv[2]), Path(sys.argv[3]))
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"s": time.perf_counter() - t, "mib": hwm / 1024}))
"""


def synthetic(dest: Path, layers: int, hidden: int) -> Path:
    """A Llama GGUF of `layers` x `hidden` (heads of 64, a quarter of them for K/V, an MLP
    2.75x as wide), its matrices Q8_0, its tokenizer and the rest of its metadata SmolLM2's."""
    import gguf
    import numpy as np

    from tokendance.backend.loader import default_gguf

    src = gguf.GGUFReader(default_gguf())
    heads, ff = hidden // 64, int(hidden * 2.75) // 256 * 256
    sizes = {"llama.block_count": layers, "llama.embedding_length": hidden, "llama.feed_forward_length": ff,
             "llama.attention.head_count": heads, "llama.attention.head_count_kv": heads // 4,
             "llama.rope.dimension_count": 64}
    w = gguf.GGUFWriter(str(dest), "llama")
    for name, f in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, sizes.get(name, f.contents()), f.types[0], sub)
    rng = np.random.default_rng(0)
    vocab = src.fields["llama.vocab_size"].contents() if "llama.vocab_size" in src.fields else 49152
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        kv = heads // 4 * 64
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv, hidden),
                       f"blk.{i}.attn_v.weight": (kv, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (ff, hidden), f"blk.{i}.ffn_up.weight": (ff, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ff)})
    for name, shape in shapes.items():
        x = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dest


def digest(folder: Path) -> dict[str, str]:
    """Each file's SHA-1; the weights' as one entry, "weights", of their names and values."""
    from safetensors import safe_open

    out = {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
           if not p.name.startswith("model.safetensors")}
    sha, held = hashlib.sha1(), {}
    with contextlib.ExitStack() as stack:
        for p in sorted(folder.glob("*.safetensors")):
            f = stack.enter_context(safe_open(str(p), "pt"))
            held.update(dict.fromkeys(f.keys(), f))
        for name in sorted(held):  # one order whatever the files, each opened once
            sha.update(name.encode() + held[name].get_tensor(name).numpy().tobytes())
    return {**out, "weights": sha.hexdigest()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="a git revision whose backend/convert.py to time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=2048)
    args = p.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    try:
        text = subprocess.run(["git", "-C", str(root), "show", f"{args.baseline}:backend/convert.py"],
                              capture_output=True, text=True, check=True).stdout
    except subprocess.CalledProcessError as e:
        print(f"--baseline: git cannot read {args.baseline}:backend/convert.py ({e.stderr.strip()})", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="convert-bench-"))
    old = work / "convert_old.py"
    old.write_text(text)
    from tokendance.backend.loader import default_gguf

    files = {"SmolLM2-135M Q4_1": default_gguf(),
             f"Llama {args.layers}x{args.hidden} Q8_0": synthetic(work / "big.gguf", args.layers, args.hidden)}
    notes: list[str] = []
    print("| file | GGUF MiB | code | wall s (median) | peak RSS MiB (median) | runs (s) |\n|---|---|---|---|---|---|")
    for label, gguf in files.items():
        runs: dict[str, list[dict]] = {"baseline": [], "this tree": []}
        sums = {}
        for r in range(args.repeats):
            for code, path in (("baseline", old), ("this tree", root / "backend" / "convert.py")):
                out = work / f"{code.replace(' ', '')}-{r}"
                res = subprocess.run([sys.executable, "-c", CHILD, str(path), str(gguf), str(out)],
                                     capture_output=True, text=True)
                if res.returncode:
                    print(res.stderr[-2000:], file=sys.stderr)
                    return 1
                runs[code].append(json.loads(res.stdout.strip().splitlines()[-1]))
                sums[code] = digest(out)
                subprocess.run(["rm", "-rf", str(out)])
        for code, rs in runs.items():
            secs = " / ".join(f"{r['s']:.1f}" for r in rs)
            print(f"| {label} | {gguf.stat().st_size >> 20} | {code} | {statistics.median(r['s'] for r in rs):.1f} "
                  f"| {statistics.median(r['mib'] for r in rs):,.0f} | {secs} |")
        same = sorted(f for f in sums["baseline"] if sums["baseline"][f] == sums["this tree"].get(f))
        other = sorted(set(sums["baseline"]) ^ set(sums["this tree"]) | set(sums["baseline"]) - set(same))
        notes.append(f"{label}: the same files {', '.join(same) or 'none'}; differ or only one has "
                     f"{', '.join(other) or 'none'}")
    print("\n".join(["", *notes]))
    subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
