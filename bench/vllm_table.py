"""Joint table of `bench/vllm_baseline.sh` results: our modes against vLLM-CPU, per N.

Standard library only (runs under any python). Reads OUT_DIR/ours-d{D}-n{N}-r{R}.json
(`tokendance bench reuse --json`, a first round in each mode, or `tokendance bench resume
--json`, a second round resumed and without) and OUT_DIR/vllm-n{N}-r{R}.json
(bench/vllm_cpu.py --json); every cell is the median over the passes R. Columns: the
modes found; a ratio to vLLM's round for `collective`, `resumed` and `prefix`.

    python3 bench/vllm_table.py OUT_DIR [--json joint.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

MODES = ["full", "prefix", "pic", "collective", "resumed", "without"]
RATIOS = ["collective", "resumed", "prefix"]


def collect(out: Path) -> dict[tuple[int, int, int], dict[str, list[float]]]:
    """{(N, round, max_tokens): {column: [value per pass]}}."""
    cells: dict[tuple[int, int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(out.glob("ours-d*-n*-r*.json")):
        for row in json.loads(f.read_text()):
            key = (row["agents"], row.get("round", 1), row.get("max_tokens", 1))
            cells[key][row["mode"]].append(row["ms"])
            cells[key]["prompt_tokens"] = [row["prompt_tokens"]]
    for f in sorted(out.glob("vllm-n*-r*.json")):
        for row in json.loads(f.read_text()):
            key = (row["agents"], row.get("round", 1), row["max_tokens"])
            cells[key]["vllm_cold"].append(row["cold_ms"])
            cells[key]["vllm_warm"].append(row["warm_ms"])
            cells[key]["prompt_tokens"] = [row["prompt_tokens"]]
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cells = collect(Path(args.out))
    rows = []
    for (n, rnd, d), c in sorted(cells.items()):
        med = {k: statistics.median(v) for k, v in c.items() if v}
        rows.append(dict(agents=n, round=rnd, max_tokens=d, passes=max(len(v) for v in c.values()),
                         **{k: round(v, 1) for k, v in med.items()},
                         **{f"{k}_all": v for k, v in c.items() if k != "prompt_tokens"}))
    modes = [m for m in MODES if any(m in r for r in rows)]
    ratios = [m for m in RATIOS if m in modes]
    head = ("| N | round | max_tokens | prompt tokens | passes | " + " | ".join(f"{m} ms" for m in modes)
            + " | vLLM cold ms | vLLM warm ms | " + " | ".join(f"{m} / vLLM cold" for m in ratios) + " |")
    lines = [head, "|" + "---|" * (len(modes) + len(ratios) + 7)]
    f = lambda v: "" if v is None else f"{v:.0f}"  # noqa: E731
    for r in rows:
        cold = r.get("vllm_cold")
        ratio = lambda m: "" if cold is None or m not in r else f"{r[m] / cold:.2f}x"  # noqa: E731
        lines.append(f"| {r['agents']} | {r['round']} | {r['max_tokens']} | {r.get('prompt_tokens', '')} | "
                     f"{r['passes']} | " + " | ".join(f(r.get(m)) for m in modes)
                     + f" | {f(cold)} | {f(r.get('vllm_warm'))} | " + " | ".join(map(ratio, ratios)) + " |")
    print("\n".join(lines))
    load = Path(args.out) / "load.txt"
    if load.exists():
        avgs = [float(m) for m in re.findall(r"load (\S+)", load.read_text())]
        if avgs:
            print(f"\n1-min load average at the start of each run: min {min(avgs):.2f}, "
                  f"median {statistics.median(avgs):.2f}, max {max(avgs):.2f} (of {len(avgs)})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
