"""Selective recomputation over reused KV (CacheBlend's forward), for a batch of Mirrors.

Every prompt arrives as a Mirror (backend/mirror.py): its reused tokens' base K/V sit in
the round's Master, its own tokens have private slots still to fill. Layers before the
check layer run in full (their K/V are then exact for every token; the early view keeps
them where the Mirror reads them). At the check layer all tokens are computed once
more, and each prompt's reused tokens whose fresh K/V deviate most from the Master's
are selected: they get private patches, in this layer and every later one. Later
layers run only the fresh and selected tokens (their hidden states carry forward);
every other reused token is read from the Master. The math per prompt does not depend
on which other prompts share the batch: attention is per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.backend.mirror import EARLY, LATE
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.sequence import Sequence
from tokendance.backend.tables import kv_view
from tokendance.backend.upload import upload, upload_list
from tokendance.kernels.deviation import kv_deviation, select_top_padded


@dataclass(slots=True)
class BlendInput:
    seq: Sequence  # a Mirror with its private blocks reserved for the prompt
    reused: list[bool]  # per prompt token: its K/V is in the Master
    start: int = 0  # tokens before it are in place already (an idle agent's restored prefix)


@dataclass(slots=True)
class BlendResult:
    logits: torch.Tensor  # [N, vocab], next-token logits per prompt
    selected: list[list[int]]  # per prompt: reused positions that were recomputed
    work: int  # token-layers computed


def _meta(items: list[BlendInput], rows: list[torch.Tensor], view: int, cache: KVCache,
          device, fresh: bool = False) -> AttnMeta:
    """Attention metadata for the given token positions (rows) of each prompt; `fresh`
    when every row of every prompt is being computed (layers before the check layer)."""
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    return AttnMeta(
        positions=upload(torch.cat(rows), device),
        cu_q=upload_list(cu, torch.int32, device),
        max_q=max(len(r) for r in rows),
        fresh_cu=cu if fresh else None,
        **kv_view([it.seq for it in items], rows, view, cache.block_size, cache.trash, device),
    )


@dataclass(slots=True)
class _Wave:
    """A part of the batch between its check-layer selection and the read-back of it."""

    items: list[BlendInput]
    full: list[torch.Tensor]  # per prompt: the token positions computed up to the check layer
    offsets: list[int]  # per prompt: its first row in x
    x: torch.Tensor  # hidden states entering the check layer
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the check layer's, every row
    picks: torch.Tensor  # per prompt: rows of x selected (select_top_padded), on the host
    ready: torch.cuda.Event | None  # when `picks` has arrived (None: it already has)
    work: int


def _split(items: list[BlendInput], waves: int) -> list[list[BlendInput]]:
    """Consecutive parts of about equal tokens, at most `waves` of them."""
    sizes = [len(it.seq.prompt) - it.start for it in items]
    total, out, acc = sum(sizes), [], 0
    for it, n in zip(items, sizes):
        if not out or (len(out) < waves and acc >= total * len(out) / waves):
            out.append([])
        out[-1].append(it)
        acc += n
    return out


def _early(model: Decoder, cache: KVCache, items: list[BlendInput], check_layer: int, ratio: float,
           floor: float) -> _Wave:
    """Queue the layers before the check layer, the check layer's K/V and the selection,
    and its copy to the host; the host does not wait for any of it."""
    device = model.rope.inv_freq.device
    full = [torch.arange(it.start, len(it.seq.prompt)) for it in items]
    # Causal attention over the step's own K/V, unless a prefix sits in the pool.
    meta = _meta(items, full, EARLY, cache, device, fresh=all(it.start == 0 for it in items))
    x = model.embed(upload_list([t for it in items for t in it.seq.prompt[it.start:]], torch.long, device))
    offsets = [0]
    for r in full:
        offsets.append(offsets[-1] + len(r))
    for layer in model.layers[:check_layer]:
        x = layer(x, meta, cache)
    layer = model.layers[check_layer]
    q, k, v = layer.self_attn.qkv(layer.input_layernorm(x))
    base = torch.cat([it.seq.mirror.master_slots(cache.block_size)[it.start:] for it in items])
    base = upload(torch.where(base >= 0, base, cache.trash), device)
    kc = cache.k[check_layer].view(-1, *k.shape[1:])
    vc = cache.v[check_layer].view(-1, *v.shape[1:])
    dev = kv_deviation(k, v, kc[base], vc[base])
    groups = [torch.nonzero(torch.tensor(it.reused[it.start:], dtype=torch.bool)).flatten() + off
              for it, off in zip(items, offsets)]
    sizes = [len(g) for g in groups]
    picks = select_top_padded(dev, list(upload(torch.cat(groups), device).split(sizes)), ratio, floor)
    ready = None
    if picks.is_cuda:
        host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
        picks = host.copy_(picks, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    return _Wave(items, full, offsets, x, (q, k, v), picks, ready, x.shape[0] * (check_layer + 1))


def _late(model: Decoder, cache: KVCache, w: _Wave, check_layer: int) -> BlendResult:
    """Read the wave's selection back, patch its Mirrors, and run the check layer's
    attention and every later layer on the fresh and selected tokens."""
    device = model.rope.inv_freq.device
    if w.ready is not None:
        w.ready.synchronize()
    items, offsets = w.items, w.offsets
    selected = []
    for it, row, off in zip(items, w.picks, offsets):
        selected.append((row[row >= 0] - off + it.start).tolist())
        it.seq.mirror.pick(selected[-1])
    layer = model.layers[check_layer]
    q, k, v = w.qkv
    meta = _meta(items, w.full, LATE, cache, device)
    cache.store(check_layer, k, v, meta.slots)
    h, x = layer.post_attention_layernorm.add(layer.self_attn.attend(q, meta, cache), w.x)
    x = x + layer.mlp(h)
    # From here on only fresh tokens, the selected ones and each prompt's last token.
    rows = []
    for it, sel in zip(items, selected):
        keep = ~torch.tensor(it.reused, dtype=torch.bool)
        keep[sel] = True
        keep[-1] = True
        keep[: it.start] = False
        rows.append(torch.nonzero(keep).flatten())
    x = x[upload(torch.cat([r - it.start + off for r, it, off in zip(rows, items, offsets)]), device)]
    meta = _meta(items, rows, LATE, cache, device)
    work = w.work
    for layer in model.layers[check_layer + 1:]:
        work += x.shape[0]
        x = layer(x, meta, cache)
    last = meta.cu_q[1:].long() - 1
    return BlendResult(model.logits(x[last]), selected, work)


@torch.inference_mode()
def blend(model: Decoder, cache: KVCache, items: list[BlendInput], check_layer: int,
          ratio: float, floor: float = 0.0, waves: int = 1) -> BlendResult:
    """The batch in up to `waves` consecutive parts, pipelined: every part's work up to
    its selection is queued first, so while the host reads one part's selection back
    and patches its Mirrors, the device computes the next part's early layers, and
    while the host prepares that next part, the device runs the first one's later
    layers. Per prompt the result does not depend on `waves`."""
    parts = [_early(model, cache, part, check_layer, ratio, floor) for part in _split(items, waves)]
    done = [_late(model, cache, w, check_layer) for w in parts]
    return BlendResult(torch.cat([d.logits for d in done]), [s for d in done for s in d.selected],
                       sum(d.work for d in done))
