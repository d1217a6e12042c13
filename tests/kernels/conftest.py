"""Kernel tests run Triton's interpreter on CPU tensors.

TRITON_INTERPRET must be set before a @triton.jit function is decorated. When an
earlier conftest already imported triton (and our kernels) without it, re-run the
decorators: triton.language's jit-defined library, then the kernel modules.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

if "triton" in sys.modules:
    import triton.language as tl

    if type(tl.max).__name__ != "InterpretedFunction":
        for mod in (tl.standard, tl.random, tl):
            importlib.reload(mod)
        # Importers after what they import: paged_attention takes names from collective.
        for name in ("tokendance.kernels.jit", "tokendance.kernels.rope", "tokendance.kernels.tiles",
                     "tokendance.kernels.paged_triton", "tokendance.kernels.collective_triton",
                     "tokendance.kernels.collective",
                     "tokendance.kernels.paged_attention", "tokendance.kernels.deviation",
                     "tokendance.kernels.diff", "tokendance.kernels.restore",
                     "tokendance.kernels.norm", "tokendance.kernels.act", "tokendance.kernels.moe",
                     "tokendance.kernels.store", "tokendance.kernels.fp8_triton", "tokendance.kernels.fp8_linear",
                     "tokendance.kernels.fp8_block_triton", "tokendance.kernels.fp8_block"):
            if name in sys.modules:
                importlib.reload(sys.modules[name])
