"""Linear layers with their weights prepacked for oneDNN: the CPU's matmuls.

bf16: `F.linear` on a CPU bf16 weight hands oneDNN a plain row-major weight on every
call; a weight reordered once into oneDNN's own layout at load gives the same outputs
1.6-3.5x faster for 1-8 rows, 1.05-1.15x for prefill-sized inputs (measured on an AMD
EPYC with bf16 instructions, where the outputs were bit-identical on SmolLM2's shapes; on
an Intel Xeon without them, one output in a few thousand rounds one bf16 step the other
way).

float32: `F.linear` goes to MKL's sgemm, whose time at 4-16 rows grows with the rows
where reading the weight once should bound it (a decode batch); oneDNN on a weight
reordered at load does not. On a 2-core Intel Xeon, SmolLM2's 30 layers at 8 rows, MKL
against packed: gate_up 19.6 against 13.0 ms, qkv 5.1 against 4.5, o_proj 3.2 against
2.5; the lm_head 14.5 against 5.7. For 1-3 rows MKL's matrix-vector path is the faster
one there (gate_up 8.3 against 10.1 ms at one row), so on an Intel CPU a float32 layer
keeps its plain weight for those and the packed copy for the rest; and only layers whose
output is at least as wide as their input are packed: down_proj (1,536 to 576) ran
slower packed at 1-10 rows (7.0 against 8.0 ms at 8). The cost is memory, 430 MB more
for SmolLM2 (the tied lm_head's packed copy included), for a batch-8 decode step in 0.81
of the time (62 against 77 ms, one process, medians of 4).
That rule was measured on an Intel CPU. On the 2-core AMD EPYC host the packed weight
is the faster at every row count and width (one SmolLM2 layer, µs, medians of 50
calls, MKL against packed, at 1 / 2 / 3 / 4 / 8 rows): qkv 45/36, 89/36, 128/39, 108/44,
113/66; gate_up 132/65, 263/69, 390/84, 352/88, 421/153; down_proj 61/47, 128/49,
269/55, 180/60, 223/107; the lm_head 10.3/5.6, 26.4/5.4, 38.1/4.6, 19.0/5.4, 17.1/5.5
ms. So the rule holds on Intel CPUs only; on any other every float32 layer is packed for
every input, and keeps no plain copy.
Outputs differ from `F.linear`'s by float32 rounding (another summation order).

The reference is `F.linear` on the unpacked weight; tests compare the two.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


FEW = 4  # on an Intel CPU, float32 inputs of fewer rows take F.linear on the plain weight


def _intel() -> bool:
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False


INTEL = _intel()  # where MKL's sgemm (F.linear's float32 path) beat the packed weight at 1-3 rows


def supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """float32 on a CPU with oneDNN, bf16 where its oneDNN has bf16 kernels."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16
                                      and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight reordered once (an opaque oneDNN tensor); with
    `few`, float32 inputs of fewer rows on the plain weight."""

    def __init__(self, linear: nn.Linear, few: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        self.plain = w if few and w.dtype == torch.float32 else None
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain is not None and x.numel() < FEW * self.in_features:
            return F.linear(x, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def worth(linear: nn.Linear, intel: bool | None = None) -> bool:
    """Whether `pack` packs this layer: bf16 ones always, float32 ones too unless on an
    Intel CPU (`intel`, None: this one) they narrow (see above)."""
    w, intel = linear.weight, INTEL if intel is None else intel
    return supported(w.dtype, w.device) and (w.dtype != torch.float32 or not intel
                                             or linear.out_features >= linear.in_features)


@torch.no_grad()
def pack(model: nn.Module, intel: bool | None = None) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear where `worth` it; returns
    how many were replaced. A tied weight (lm_head = embeddings) gets its own packed copy
    and the embedding keeps the original. `intel`: MKL's fast kernels run here (None: on
    this CPU, see above)."""
    intel = INTEL if intel is None else intel
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children()
             if isinstance(child, nn.Linear) and worth(child, intel)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, few=intel))
    return len(swaps)
