"""Where a checkpoint's tensors go in a built model (backend/loader.py reads them): wide rows
copied into wide parameters; 8-bit rows (e4m3 with a scale per row or per tensor, an FP8
checkpoint's) copied into 8-bit projections byte for byte, or widened into wide parameters
(an expert's, a router's); wide rows into 8-bit projections rounded as they are read
(--quantization fp8), so the wide model is never held whole.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import structlog
import torch
from torch import nn

from tokendance.backend.parallel import Shard, shard_weight
from tokendance.backend.quant import Quant
from tokendance.backend.start import Linear, drawing
from tokendance.kernels.fp8_block import BlockFp8Linear, dequantize
from tokendance.kernels.fp8_linear import E4M3, Fp8Linear, quantize_rows, widen

log = structlog.get_logger(__name__)


class Misfit(ValueError):
    """A checkpoint tensor that does not fit the model: the loader says where."""


def scales(stored: str, w: torch.Tensor, get: Callable[[str], torch.Tensor | None],
           block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An e4m3 weight's scales, one per row ([..., rows, 1], float32) or, block-wise, one per
    block ([..., rows / bn, columns / bk], the last block of each partial), and its input
    scale where the checkpoint has one; `get(name)` reads a tensor (None: not in the
    checkpoint)."""
    stem = stored.removesuffix(".weight")
    s = get(f"{stem}.weight_scale")
    s = get(f"{stem}.weight_scale_inv") if s is None else s  # the fp8 block format's name
    if s is None:
        raise Misfit(f"in e4m3, but the checkpoint holds no {stem}.weight_scale")
    if block is not None:
        want = (*w.shape[:-2], -(-w.shape[-2] // block[0]), -(-w.shape[-1] // block[1]))
        if tuple(s.shape) != want:
            raise Misfit(f"{stem}'s scales have shape {tuple(s.shape)}, not one per {block[0]} x {block[1]} "
                         f"block of {tuple(w.shape)}: {want}")
        return s.float().contiguous(), None
    rows = w.shape[:-1]
    if s.numel() == 1:
        s = s.reshape([1] * len(rows) + [1]).expand(*rows, 1)
    elif s.numel() == prod(rows):
        s = s.reshape(*rows, 1)
    else:
        raise Misfit(f"{stem}.weight_scale has shape {tuple(s.shape)}: not one per tensor or per row of "
                     f"{tuple(w.shape)} (block-wise scales are not supported)")
    x = get(f"{stem}.input_scale")
    if x is not None and x.numel() != 1:
        raise Misfit(f"{stem}.input_scale has shape {tuple(x.shape)}: a static input scale is one number")
    return s.float().contiguous(), None if x is None else x.float().reshape(())


class Placer:
    """Puts a checkpoint's tensors, as backend/loader.py names them, into `model`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, tp: Shard | None, quant: Quant | None,
                 whose: str = "the config"):
        self.model, self.dtype, self.tp, self.quant, self.whose = model, dtype, tp, quant, whose
        self.held = self._held()
        self.inputs: set[str] = set()  # the static projections given their input scale
        self.written: set[str] = set()  # the targets given rows

    def _held(self) -> dict[str, torch.Tensor]:
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}

    def has(self, target: str) -> bool:
        return target in self.held

    def put(self, name: str, target: str, expert: int | None, off: int | None, w: torch.Tensor,
            s: torch.Tensor | None, x_scale: torch.Tensor | None) -> None:
        """`name`'s rows (w: wide, or e4m3's bytes with scales `s`) from `off` in `target`
        (stacked experts: `expert`'s); Misfit where their shapes differ."""
        module = self.model.get_submodule(target.rsplit(".", 1)[0])
        eight = isinstance(module, (Fp8Linear, BlockFp8Linear)) and target.endswith(".weight")  # not its bias
        block = self.quant.block if self.quant is not None else None
        if s is not None and block is not None and not (eight and self._whole(name, w, block)):
            # widened whole, then shared out as a wide tensor: an expert's, the lm_head's, a share not whole blocks
            w, s = dequantize(w, s, block), None
        src = shard_weight(name, w, self.tp)
        # a tensor-parallel rank's vocabulary share may hold fewer rows than its parameter
        rows = slice(off or 0, (off or 0) + src.shape[0])
        if eight and s is None and self.quant is not None and self.quant.stored:
            module, eight = self._widen(target), False  # a projection the checkpoint keeps wide (its ignore list)
        if eight and block is not None and (rows.start % block[0] or src.shape[0] % block[0]):
            module, eight = self._widen(target), False  # a fused part that is not whole blocks
        dst = self.held[target] if expert is None else self.held[target][expert]
        if dst[rows].shape != src.shape:
            raise Misfit(f"has shape {tuple(w.shape)}, not what {self.whose} gives")
        self.written.add(target)
        if s is not None:  # block scales are shared out as their weight is (whole blocks: `_whole`)
            s = shard_weight(name if block is not None else name.removesuffix(".weight") + ".weight_scale", s, self.tp)
        if not eight:
            if s is not None:
                src = widen(src.view(E4M3)) * s if block is None else dequantize(src, s, block)
            dst[rows].copy_(src.to(self.dtype))
            return
        if s is None:  # a wide row, rounded on the device it is held on
            src, s = quantize_rows(src.to(dst.device))
        module.put(rows.start, src, s)
        if getattr(module, "input_scale", None) is not None:
            if x_scale is None:
                raise Misfit("the checkpoint's inputs take static scales, but it holds no "
                             f"{name.removesuffix('.weight')}.input_scale")
            # q, k and v (gate and up) read one input: the largest of their scales, as vLLM
            first = target not in self.inputs
            module.input_scale.copy_(x_scale if first else torch.maximum(module.input_scale, x_scale.to(dst.device)))
            self.inputs.add(target)

    def _whole(self, name: str, w: torch.Tensor, block: tuple[int, int]) -> bool:
        """Whether each rank's share of a block-wise weight is whole blocks, so that its
        scales split as it does (every share, when one process holds it all)."""
        if self.tp is None or self.tp.size == 1:
            return True
        part = shard_weight(name, w, self.tp)  # a view
        for dim, b in ((-2, block[0]), (-1, block[1])):
            if part.shape[dim] != w.shape[dim]:
                return w.shape[dim] % (self.tp.size * b) == 0
        return True

    def _widen(self, target: str) -> nn.Linear:
        """The projection holding `target` as an nn.Linear of its rows so far."""
        path = target.rsplit(".", 1)[0]
        parent, attr = path.rsplit(".", 1)
        old: Fp8Linear | BlockFp8Linear = self.model.get_submodule(path)
        with drawing(False):
            new = Linear(old.in_features, old.out_features, bias=old.bias is not None, device=old.weight.device,
                         dtype=self.dtype)
        new.weight.copy_(old.wide(self.dtype))
        new.bias = old.bias
        setattr(self.model.get_submodule(parent), attr, new)
        self.held = self._held()
        log.info("kept wide, as the checkpoint holds it", projection=path)
        return new

    def check(self) -> None:
        """Misfit where a weight got no rows (the model was built without drawing any: what
        memory held would be served) or a static projection no input scale."""
        eight = [name for name, b in self.model.named_buffers() if b.dtype == E4M3]
        for name in [*dict(self.model.named_parameters()), *eight]:
            if name not in self.written:
                raise Misfit(f"the checkpoint holds no {name}, which the model {self.whose} describes has")
        for path, m in self.model.named_modules():
            if isinstance(m, Fp8Linear) and m.input_scale is not None and f"{path}.weight" not in self.inputs:
                raise Misfit(f"the checkpoint's inputs take static scales, but it holds none for {path}")


def multiply(proj: nn.Module, by: float) -> None:
    """A projection's output times `by` (Granite's residual multiplier, folded in)."""
    (proj.scale if isinstance(proj, Fp8Linear) else proj.weight).mul_(by)
