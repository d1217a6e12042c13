"""A CUDA check of tensor parallelism on a machine of one GPU: two ranks on it (gloo
between them, no CUDA graphs: backend/parallel.py's ONE_DEVICE) serve two All-Gather
rounds in each mode and must give one process's greedy tokens. The speed of the split
needs GPUs of its own: `bench parallel` on nvidia-h200-x2 and up.
python -m tokendance.bench.check_parallel

With --death, instead: how long a leader's step takes to fail when its follower is
killed during it, over NCCL on two GPUs (gloo on one, or on the CPU), and with what
error (NCCL's watchdog may end the process at its timeout instead: then no line).
python -m tokendance.bench.check_parallel --death"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch

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


def death(model: str, device: str) -> tuple[float, str]:
    """(seconds from the follower's kill to the leader's failed step, the error) of a
    two-rank engine on `device` whose follower is killed once it took a step's call,
    before the collectives it owes the leader (tests/backend/test_parallel.py does the
    same on the CPU)."""
    two = Engine(EngineConfig(model=model, dtype="float32", device=device, cuda_graphs=0,
                              kv_tokens=16384, tensor_parallel_size=2))
    try:
        two.add("a", [(i * 7919) % 40000 + 100 for i in range(2048)], GREEDY)
        step, killed = two._step, []

        def dying() -> list:
            two.tp.procs[0].kill()
            killed.append(time.monotonic())
            return step()

        two._step = dying
        try:
            two.step()
        except Exception as e:  # what the step that lost its follower raised
            return time.monotonic() - killed[0], f"{type(e).__name__}: {str(e)[:120]}"
        return math.nan, "no error"
    finally:
        two.close()


def main() -> int:
    if "--death" in sys.argv:
        gpus = torch.cuda.device_count()
        device = "cuda" if gpus else "cpu"
        if gpus == 1:
            os.environ[parallel.ONE_DEVICE] = "1"
        took, err = death(str(folder()), device)
        link = "NCCL" if gpus >= 2 else "gloo"
        print(f"tensor parallelism, a follower killed during a step ({device}, {link}): the leader's step "
              f"failed {took:.2f} s later with {err}")
        return 0 if took == took else 1
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
