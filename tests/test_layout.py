"""The repository's shape: dependencies flow one way (adapters -> proxy -> backend ->
kernels), and no installed distribution claims one of our folders' names."""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "backend", "proxy", "adapters")  # each may import those before it
ON_TOP = ("bench", "examples")  # may import any layer; no layer imports them
# Folders that hand a clashing top-level name over to the installed package.
HANDED_OVER = ("kernels",)


def imported(path: Path, folder: str) -> set[str]:
    """The tokendance folders a module imports (relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else [f"tokendance.{folder}"]
        else:
            continue
        out |= {n.split(".")[1] for n in names if n.startswith("tokendance.")}
    return out


def upward(folder: str, root: Path = ROOT) -> list[str]:
    """'module: imports X' for every import of `folder` that goes against the flow."""
    allowed = set(LAYERS[: LAYERS.index(folder) + 1])
    return [f"{p.relative_to(root)}: imports tokendance.{dep}"
            for p in sorted((root / folder).rglob("*.py")) for dep in sorted(imported(p, folder) - allowed)]


@pytest.mark.parametrize("folder", LAYERS)
def test_dependencies_flow_one_way(folder):
    assert upward(folder) == []


def test_an_import_against_the_flow_is_found(tmp_path):
    (tmp_path / "backend").mkdir()
    (tmp_path / "backend" / "x.py").write_text("from . import y\nimport tokendance.proxy.app\n")
    (tmp_path / "backend" / "y.py").write_text("from tokendance.kernels import rope\n")
    assert upward("backend", tmp_path) == ["backend/x.py: imports tokendance.proxy"]


def test_every_top_level_folder_is_a_package_here():
    folders = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert folders == set(LAYERS + ON_TOP)


@pytest.mark.parametrize("folder", sorted(set(LAYERS + ON_TOP) - set(HANDED_OVER)))
def test_no_installed_distribution_claims_the_name(folder):
    """Run from the checkout's root (pytest, `python -m`), our folder is found first
    under its bare name and would shadow an installed package of that name, as
    `kernels/` shadowed Hugging Face's once transformers 5.25 imported it."""
    owners = importlib.metadata.packages_distributions().get(folder)
    assert not owners, (f"{owners} install a top-level `{folder}`, which our {folder}/ shadows from the "
                        "checkout's root: hand the name over as kernels/__init__.py does")
