"""Selective recomputation over reused KV (CacheBlend's forward), for a batch of Mirrors.

Every prompt arrives as a Mirror (backend/mirror.py): its reused tokens' base K/V sit in
the round's Master, its own tokens have private slots still to fill. Layers before the
check layer run in full (their K/V are then exact for every token; the early view keeps
them where the Mirror reads them). At the check layer every token's K/V are computed
once more, and each prompt's reused tokens whose fresh K/V deviate most from the
Master's are selected: they get private patches, in this layer and every later one.
From the check layer's attention on, only the fresh and selected tokens run (their
hidden states carry forward); every other reused token is read from the Master. The
selection stays on the device: the later layers' metadata is built there from it
(backend/late.py), and the host reads it back for the Mirrors only once every layer is
queued. The math per prompt does not depend on which other prompts share the batch:
attention is per sequence.

A batch may also carry bases: shared segments computed in this same forward (sequences
without a Mirror, nothing reused, every layer in full). They come before the Mirrors that
read them, and at the check layer their K/V are stored before any Mirror's deviation
reads them; in every other layer each token's K/V are stored before attention reads any.
A prompt without a Mirror may also mark tokens reused (backend/kvcomm.py): their K/V
from the check layer on are in its own slots already, and stay as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.backend.late import plan
from tokendance.backend.mirror import EARLY
from tokendance.backend.model import AttnMeta, Decoder, KVCache
from tokendance.backend.sequence import Sequence
from tokendance.backend.tables import kv_view
from tokendance.backend.upload import Download, download, upload, upload_list
from tokendance.kernels.deviation import caps, kv_deviation, select_top_padded
from tokendance.kernels.fp8 import narrow


@dataclass(slots=True)
class BlendInput:
    seq: Sequence  # a Mirror with its private blocks reserved for the prompt, or a base
    reused: list[bool]  # per prompt token: its K/V is in the Master (a base: none; kvcomm: in place)
    start: int = 0  # tokens before it are in place already (an idle agent's restored prefix)


@dataclass(slots=True)
class BlendResult:
    logits: torch.Tensor  # [N, vocab], next-token logits per prompt
    selected: list[list[int]]  # per prompt: reused positions that were recomputed
    work: int  # token-layers computed


def _early_meta(items: list[BlendInput], rows: list[torch.Tensor], cache: KVCache, device,
                fresh: bool) -> AttnMeta:
    """Attention metadata of the layers before the check layer, every row computed;
    `fresh`: no prompt has a prefix in the pool (attention reads the step's own K/V)."""
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    return AttnMeta(
        positions=upload(torch.cat(rows), device),
        cu_q=upload_list(cu, torch.int32, device),
        max_q=max(len(r) for r in rows),
        fresh_cu=cu if fresh else None,
        **kv_view([it.seq for it in items], rows, EARLY, cache.block_size, cache.trash, device,
                  reads=not fresh),
    )


@dataclass(slots=True)
class Early:
    """The layers before the check layer of whole fresh prompts, queued before their
    Mirrors exist (their attention reads only the step's own K/V), so the GPU computes
    them while the host builds the Mirrors; their K/V wait here until `blend` stores them
    where the Mirrors say."""

    seqs: list[Sequence]
    x: tuple[torch.Tensor, torch.Tensor]  # hidden states entering the check layer (a pair)
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per early layer


class _Held:
    """Stands in for the KV cache in `early`: keeps each layer's K/V instead."""

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        self.kv.append((k, v))


@torch.inference_mode()
def early(model: Decoder, seqs: list[Sequence], check_layer: int) -> Early:
    """Queue the layers before the check layer over whole prompts (see `Early`)."""
    device = model.rope.inv_freq.device
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s.prompt))
    none = torch.zeros(len(seqs), 0, dtype=torch.int32, device=device)  # nothing stored or read
    meta = AttnMeta(positions=upload(torch.cat([torch.arange(len(s.prompt)) for s in seqs]), device),
                    slots=none, cu_q=upload_list(cu, torch.int32, device), block_tables=none,
                    kv_lens=none.sum(1), max_q=max(len(s.prompt) for s in seqs), fresh_cu=cu)
    x, res = model.embed(upload_list([t for s in seqs for t in s.prompt], torch.long, device)), None
    held = _Held()
    for layer in model.layers[:check_layer]:
        x, res = layer(x, meta, held, res)
    return Early(seqs, (x, res), held.kv)


@torch.inference_mode()
def blend(model: Decoder, cache: KVCache, items: list[BlendInput], check_layer: int,
          ratio: float, floor: float = 0.0, pre: Early | None = None) -> BlendResult:
    """`pre`: these items' early layers, if `early` ran them (else ignored)."""
    device = model.rope.inv_freq.device
    bsz = cache.block_size
    full = [torch.arange(it.start, len(it.seq.prompt)) for it in items]
    # Causal attention over the step's own K/V, unless a prefix sits in the pool.
    meta = _early_meta(items, full, cache, device, fresh=all(it.start == 0 for it in items))
    offsets = [0]
    for r in full:
        offsets.append(offsets[-1] + len(r))
    reused = [torch.tensor(it.reused, dtype=torch.bool) for it in items]
    back: Download | None = None  # the check layer's picks, on their way to the host
    work, first = 0, 0
    if pre is not None and len(pre.seqs) == len(items) and all(
            s is it.seq and it.start == 0 for s, it in zip(pre.seqs, items)):
        for li, (k, v) in enumerate(pre.kv):
            cache.store(li, k, v, meta.slots)
        (x, res), first = pre.x, check_layer
        work = x.shape[0] * check_layer
    else:
        ids = [t for it in items for t in it.seq.prompt[it.start:]]
        x, res = model.embed(upload_list(ids, torch.long, device)), None
    for li, layer in enumerate(model.layers[first:], first):
        work += x.shape[0]
        if li != check_layer:
            x, res = layer(x, meta, cache, res)
            continue
        attn = layer.self_attn
        h, res = layer.pre(x, res)
        q, k, v = attn.qkv(h)
        base = torch.cat([it.seq.mirror.master_slots(bsz)[it.start:] if it.seq.mirror is not None
                          else torch.full((len(r),), -1) for it, r in zip(items, full)])
        base = upload(torch.where(base >= 0, base, cache.trash), device)
        kc = cache.k[li].view(-1, *k.shape[1:])
        vc = cache.v[li].view(-1, *v.shape[1:])
        bases = [i for i, it in enumerate(items) if it.seq.mirror is None and not any(it.reused)]
        if bases:  # the Master computed in this forward: in place before anyone compares
            own = upload(torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in bases]), device)
            cache.store(li, k[own], v[own], meta.slots[own])
        # as the pool would hold them: an 8-bit pool's rounding alone is no deviation
        dev = kv_deviation(narrow(k, kc.dtype), narrow(v, vc.dtype), kc[base], vc[base],
                           None if model.tp is None else model.tp.sum)
        groups = [torch.nonzero(r[it.start:]).flatten() + off for r, it, off in zip(reused, items, offsets)]
        sizes = [len(g) for g in groups]
        picks = select_top_padded(dev, list(upload(torch.cat(groups), device).split(sizes)), ratio, floor)
        back = download(picks)
        # The host plans the later layers while the GPU selects; with a floor it must
        # wait for the counts (they depend on the deviations).
        late = plan([it.seq for it in items], reused, [it.start for it in items], offsets, bsz,
                    cache.trash, device)
        counts = caps(sizes, ratio) if floor <= 0 else (back.get() >= 0).sum(1).tolist()
        meta, take = late.meta(picks, counts)
        q = attn.store(q[take], k[take], v[take], meta, cache)
        x, res = layer.post(attn.attend(q, meta, cache), res[take])
    last = meta.cu_q[1:].long() - 1
    logits = model.logits(x[last], res[last])
    selected: list[list[int]] = [[] for _ in items]
    if back is not None:  # every layer is queued: the Mirrors take their patches now
        for i, (it, row) in enumerate(zip(items, back.get())):
            selected[i] = (row[row >= 0] - offsets[i] + it.start).tolist()
            if it.seq.mirror is not None:
                it.seq.mirror.pick(selected[i])
    return BlendResult(logits, selected, work)
