"""Linear layers with their weights prepacked for oneDNN: the CPU's bf16 matmuls.

`F.linear` on a CPU bf16 weight hands oneDNN a plain row-major weight on every call; a
weight reordered once into oneDNN's own layout at load gives the same outputs 1.6-3.5x
faster for 1-8 rows, 1.05-1.15x for prefill-sized inputs (measured on an AMD EPYC with
bf16 instructions, where the outputs were bit-identical on SmolLM2's shapes; on an Intel
Xeon without them, one output in a few thousand rounds one bf16 step the other way).
The reference is `F.linear` on the unpacked weight; tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """bf16 on a CPU whose oneDNN has bf16 kernels (fp32 keeps F.linear, which is what HF
    runs: our fp32 outputs are the exact reference)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`nn.Linear`'s forward on a weight reordered once (an opaque oneDNN tensor)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@torch.no_grad()
def pack(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear where `supported`; returns
    how many were replaced. A tied weight (lm_head = embeddings) gets its own packed copy
    and the embedding keeps the original."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)
             and supported(child.weight.dtype, child.weight.device)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
