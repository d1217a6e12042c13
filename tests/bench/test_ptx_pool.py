"""bench/ptx.py --pool: the kernels compiled for sm_90 over an 8-bit pool. Their values
reach the product with the scores widened in registers, not gathered byte by byte from
shared memory (kernels/tiles.py `_values`), and over bf16 they compile as a plain read
of a tile of slots does."""

import re
import sys

import pytest

from .test_head_dims_bench import edited_kernels, run_ptx


@pytest.fixture
def plain(tmp_path, monkeypatch):
    """Our kernels folder with an 8-bit pool's values read as any pool's: a tile of slots."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def edit(text: str) -> str:
        text = text.replace("if vc.dtype.element_ty.is_fp8():", "if False:")
        text = text.replace("if vp.dtype.element_ty.is_fp8():", "if False:")
        assert text.count("if False:") == 2
        return text

    yield from edited_kernels(tmp_path / "plain", "tiles.py", edit)


def rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines() if line.startswith("| _")]


def test_8_bit_values_are_widened_in_registers(plain):
    pytest.importorskip("triton.backends.nvidia")
    fp8 = run_ptx("--baseline", plain, "--dims", "64", "--kernels", "_decode_kernel", "--pool", "fp8")
    assert "K/V in fp8" in fp8.stdout and fp8.returncode == 1, fp8.stdout + fp8.stderr
    (row,) = rows(fp8.stdout)
    assert row[6] == "0" and int(re.split(", ", row[7])[2]) > 0  # ours gather no byte; the plain read does
    bf16 = run_ptx("--baseline", plain, "--dims", "64", "--kernels", "_decode_kernel")
    assert bf16.returncode == 0 and rows(bf16.stdout)[0][-1] == "True"
