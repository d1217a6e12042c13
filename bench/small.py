"""The small engines the CUDA checks run (bench/check_cuda.py, bench/check_serving.py):
a shape's widths with fewer layers, and seeded fp32 weights the same in every engine."""

from __future__ import annotations

import json
import shutil

import torch

from tokendance.backend.config import EngineConfig
from tokendance.backend.engine import Engine
from tokendance.bench.shapes import SHAPES, shape_folder

# Their rounds' outputs (8-60 tokens) are shorter than the length CUDA reuses from by default:
# every engine here reuses all of them, so the Mirror paths are what it checks.
REUSE_ALL = {"min_shared_tokens": 0}


def small_folder(layers: int = 4, shape: str = "qwen2.5-7b"):
    """A shape's widths (Qwen2.5-7B's by default) with fewer layers: quick to build, same
    kernel shapes."""
    src = shape_folder(shape)
    out = src.parent / f"{shape}-{layers}l"
    out.mkdir(exist_ok=True)
    cfg = dict(SHAPES[shape], num_hidden_layers=layers)
    (out / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


def seeded(**cfg) -> Engine:
    """An fp32 engine on small_folder(2) whose random weights are the same in every engine
    made here (on the CPU some are packed, kernels/packed.py, and no longer parameters:
    the seed comes before the engine draws them too)."""
    torch.manual_seed(0)
    eng = Engine(EngineConfig(model=str(small_folder(2)), dtype="float32", random_weights=True, seed=0,
                              **REUSE_ALL, **cfg))
    torch.manual_seed(0)
    for p in eng.model.parameters():
        p.data.normal_(0, 0.02)
    return eng
