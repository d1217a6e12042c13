"""kernels/ imports as tokendance.kernels; run from the checkout's root it must not take
the top-level name `kernels` from the installed package of that name (Hugging Face's,
which transformers >= 5.25 imports)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(code: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)


def test_the_installed_package_keeps_its_name(tmp_path):
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("WHO = 'installed'\n")
    out = run("import kernels; print(kernels.WHO)", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "installed"


def test_without_one_the_folder_stays_an_empty_module():
    # transformers then finds no version and no usable `kernels` (its state before 5.25)
    out = run("import sys; sys.path[:] = [''] + [p for p in sys.path if 'site-packages' not in p]; "
              "import kernels; print(kernels.__file__, hasattr(kernels, 'CUDAProperties'))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), "False"]
