"""The head-dim benchmarks' pieces that run without a GPU: the shapes bench/head_dims.py
times load with the head dims they are there for, and bench/ptx.py compiles kernels for
a GPU here and tells an earlier checkout's PTX from ours."""

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokendance.backend.config import ModelConfig
from tokendance.bench import head_dims, ptx, shapes
from tokendance.kernels import rope


def test_the_shapes_have_head_dims_that_are_not_powers_of_two(monkeypatch, tmp_path, smollm2):
    monkeypatch.setattr(shapes.loader, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("TOKENDANCE_TOKENIZER", str(smollm2))
    got = {name: ModelConfig.load(shapes.shape_folder(name)) for name in head_dims.SHAPES}
    assert {n: (c.arch, c.head_dim, c.num_heads, c.num_kv_heads) for n, c in got.items()} == {
        "danube3-4b": ("llama", 120, 32, 8), "danube2-1.8b": ("mistral", 80, 32, 8)}


def edited_kernels(dest: Path, name: str, edit) -> Iterator[str]:
    """A copy of our kernels folder in dest with file `name`'s text put through `edit`;
    yields its path, then drops the packages loaded from it (`ptx.load_baseline`)."""
    dest.mkdir()
    for f in Path(rope.__file__).parent.glob("*.py"):
        dest.joinpath(f.name).write_text(edit(f.read_text()) if f.name == name else f.read_text())
    yield str(dest)
    for m in [m for m in sys.modules if m.startswith("tdbase")]:
        del sys.modules[m]


@pytest.fixture
def baseline(tmp_path, monkeypatch):
    """Our kernels folder with the RoPE kernel differing in one constant."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield from edited_kernels(tmp_path / "old", "rope.py", lambda text: text.replace(
        "tl.store(dst + HALF, (x2 * c + x1 * s)", "tl.store(dst + HALF, (x2 * c - x1 * s)"))


def test_a_baseline_kernels_folder_loads_as_its_own_package(baseline):
    mod = ptx.load_baseline(baseline)("paged_triton")
    assert mod.__name__ == "tdbase.kernels.paged_triton"
    assert sys.modules["tdbase.kernels.tiles"] is not sys.modules["tokendance.kernels.tiles"]
    assert mod._attend_ranges is sys.modules["tdbase.kernels.tiles"]._attend_ranges  # its own imports rewritten


def run_ptx(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernel tests set it
    return subprocess.run([sys.executable, "-m", "tokendance.bench.ptx", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_ptx_for_a_gpu_compiled_here_and_compared(baseline):
    """The RoPE kernel for sm_90 at a padded head dim (80) and an exact one (64): ptxas's
    registers, and the baseline's changed sign shows in its PTX (exit 1); our own folder
    as the baseline compiles the same."""
    pytest.importorskip("triton.backends.nvidia")
    out = run_ptx("--baseline", baseline, "--dims", "80,64", "--kernels", "_rope_kernel")
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| _rope")]
    assert out.returncode == 1 and [(r[1].strip(), r[-1].strip()) for r in rows] == [("80", "False"), ("64", "False")]
    assert all(0 < int(r[3]) <= 255 and r[4].strip() == "0" for r in rows), out.stdout
    same = run_ptx("--baseline", str(Path(rope.__file__).parent), "--dims", "64", "--kernels", "_rope_kernel")
    assert same.returncode == 0 and "| _rope_kernel | 64 |" in same.stdout and same.stdout.rstrip().endswith("True |")
    bad = run_ptx("--kernels", "_nope")
    assert bad.returncode == 2 and bad.stderr.startswith("--kernels: unknown _nope")


def test_a_baseline_can_be_a_git_revision(tmp_path):
    """`--baseline REV`: the kernels folder of that revision, as git holds it."""
    rev = subprocess.run(["git", "-C", str(ptx.ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if rev.returncode != 0:
        pytest.skip("not a git checkout")
    folder = Path(ptx.from_git("HEAD"))
    shown = subprocess.run(["git", "-C", str(ptx.ROOT), "show", "HEAD:kernels/rope.py"], capture_output=True,
                           text=True).stdout
    assert (folder / "rope.py").read_text() == shown and (folder / "paged_triton.py").exists()
    with pytest.raises(ValueError, match="git cannot read 'no-such-rev'"):
        ptx.from_git("no-such-rev")
    bad = run_ptx("--baseline", "no-such-rev", "--kernels", "_rope_kernel")
    assert bad.returncode == 2 and bad.stderr.startswith("--baseline: not a folder, and git cannot read")
