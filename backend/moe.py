"""A layer's MLP: dense (SwiGLU), or a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE, GraniteMoE).

A router scores every expert for each token; the token goes through the k best experts'
SwiGLU MLPs, and their outputs are summed, weighted by the router's softmax over all
experts (renormalised over the k chosen where the model says so). Qwen2-MoE adds a
shared expert, a dense MLP every token takes, its output scaled by a sigmoid gate. The
experts' weights are stacked, [E, 2I, H] (gate rows, then up) and [E, H, I], so one
kernel launch (kernels/moe.py) serves every expert. Under tensor parallelism each rank
holds every expert's share of the MLP width, as it holds a dense MLP's, and the ranks'
partial outputs are summed; the router is whole on every rank and picks alike.
"""

from __future__ import annotations

import torch
from torch import nn

from tokendance.backend.config import ModelConfig
from tokendance.backend.parallel import Shard
from tokendance.backend.quant import linear
from tokendance.backend.start import DRAW, Linear
from tokendance.kernels.act import gelu_tanh_mul, silu_mul
from tokendance.kernels.moe import moe


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one projection (GeGLU,
    gelu_tanh in silu's place, where the model says so)."""

    def __init__(self, cfg: ModelConfig, tp: Shard | None = None, width: int | None = None):
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_up_proj = linear(cfg.quant, cfg.hidden_size, 2 * width, False)
        self.down_proj = linear(cfg.quant, width, cfg.hidden_size, False)
        self.act = gelu_tanh_mul if cfg.act == "gelu_tanh" else silu_mul
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down_proj(self.act(self.gate_up_proj(x)))
        return x if self.tp is None else self.tp.sum(x)


class Experts(nn.Module):
    """The stacked expert weights, named as transformers names them in memory."""

    def __init__(self, n: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(n, hidden, width))
        if DRAW.get():  # as nn.Linear starts its weights: random-weight engines (timing) use these
            for p, fan_in in ((self.gate_up_proj, hidden), (self.down_proj, width)):
                nn.init.uniform_(p, -fan_in ** -0.5, fan_in ** -0.5)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Shard | None = None):
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.experts, bias=False)  # the router
        self.experts = Experts(cfg.experts, cfg.hidden_size, cfg.expert_size)
        self.k, self.norm = cfg.experts_per_token, cfg.norm_topk
        self.tp = tp
        if cfg.shared_expert_size:
            self.shared_expert = MLP(cfg, width=cfg.shared_expert_size)  # summed with the rest, once
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.k, self.norm)
        y = moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights.to(x.dtype), ids)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y if self.tp is None else self.tp.sum(y)


def route(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): the k largest of the softmax over all
    experts, taken in float32 as transformers takes them, renormalised with `norm`."""
    weights, ids = logits.float().softmax(-1).topk(k, -1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids
