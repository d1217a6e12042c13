"""A CUDA check of tensor parallelism on a machine of one GPU: two ranks on it (gloo
between them, no CUDA graphs: backend/parallel.py's ONE_DEVICE) serve two All-Gather
rounds in each mode and must give one process's greedy tokens. The speed of the split
needs GPUs of its own: `bench parallel` on nvidia-h200-x2 and up.
python -m tokendance.bench.check_parallel"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tokendance.backend import parallel
from tokendance.backend.api import SamplingParams
from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.bench.allgather import make_round, next_round
from tokendance.bench.shapes import save_random, shape_folder

MODES = ("full", "prefix", "collective", "kvcomm")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def folder(layers: int = 4) -> Path:
    """A Qwen2.5-0.5B shape (14 heads, 2 KV heads: both split in two) of `layers` layers,
    random weights saved, so every rank loads the same ones."""
    out = shape_folder("qwen2.5-0.5b").parent / f"qwen2.5-0.5b-{layers}l-saved"
    return out if (out / "config.json").exists() else save_random("qwen2.5-0.5b", out, layers=layers)


def rounds(eng: Engine) -> dict[str, list[list[int]]]:
    """Each mode's answers, two rounds from cold caches, agents named (parked, resumed)."""
    out = {}
    for mode in MODES:
        eng.reset_caches()
        rnd, answers = make_round(6, 200, 60, 49152, seed=1), []
        for r in range(2):
            for i, (p, sp) in enumerate(zip(rnd.prompts, rnd.shared)):
                eng.add(f"{mode}{r}-{i}", p, GREEDY, mode=mode, shared=sp, agent=f"a{i}")
            got: dict[str, list[int]] = {}
            while eng.has_work():
                for rid, d in eng.step():
                    got.setdefault(rid, []).extend(d.token_ids)
            answers = [got[f"{mode}{r}-{i}"] for i in range(rnd.agents)]
            out[f"{mode} round {r + 1}"] = answers
            rnd = next_round(rnd, answers, 60, 49152, seed=2 + r)
    return out


def main() -> int:
    os.environ[parallel.ONE_DEVICE] = "1"
    cfg = dict(model=str(folder()), dtype="float32", device="cuda", cuda_graphs=0, kv_tokens=32768,
               min_shared_tokens=0)
    want = rounds(Engine(EngineConfig(**cfg)))
    two = Engine(EngineConfig(**cfg, tensor_parallel_size=2))
    try:
        got = rounds(two)
    finally:
        two.close()
    same = [k for k in want if got[k] == want[k]]
    print(f"tensor parallelism, 2 ranks on one GPU (gloo, fp32, lookahead on): {len(same)}/{len(want)} "
          f"rounds give one process's greedy tokens ({', '.join(k for k in want if k not in same) or 'all'}"
          f"{' differ' if len(same) < len(want) else ''}); the ranks agreed {two.tp.agreed}")
    return 0 if len(same) == len(want) and two.tp.agreed else 1


if __name__ == "__main__":
    sys.exit(main())
