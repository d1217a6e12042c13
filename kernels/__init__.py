"""Triton kernels, each beside the plain-torch reference that defines it."""

if __name__ == "kernels":
    # This folder imports as tokendance.kernels. Found as a top-level `kernels` (the
    # checkout's root on sys.path: `python -m` or pytest run from there), it would shadow
    # the installed package of that name, Hugging Face's, which transformers >= 5.25
    # imports: hand the name over to it. Without one it stays this (empty) module, which
    # transformers reads as no usable `kernels`.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # what `import kernels` returns once this file ends
        _spec.loader.exec_module(_module)
