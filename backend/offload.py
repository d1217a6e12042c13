"""The host tier: idle agents' KV in host memory, restored fused.

Between rounds an idle agent is a Mirror: it reads the round's shared segments from
Master blocks and owns private slots for its own tokens and patches. Offloading it
keeps that split: each Master segment goes to the host once (`put_master`), each agent
only its private slots (`park`). `restore` brings a group back in one host-to-device
copy per entry into one device staging buffer and ONE `scatter_slots` launch: every
Master once, each agent's private slots, written straight into fresh pool slots (no
dense copy of any agent is ever built).

A vLLM-style dense tier is the same API with no Masters and every token private.

Host entries are rows of [layers, 2, Hkv, D], one token each, in pages of the tier's
arena (backend/arena.py: pinned when the pool is on CUDA, once), so an entry is a few
contiguous ranges and the staging buffer their concatenation. Copies run on the current
stream without host syncs: a host entry is complete in stream order, which is all a
later restore on the same stream needs.

References: every `put_master` holds one reference for its caller until
`release_master`; every parked agent holds one on each Master it reads until it is
restored, dropped or evicted. A Master with no references left is freed. The budget
(host bytes, Masters counted once) is enforced when agents are parked: least recently
parked agents are evicted first, and an agent that cannot fit even then is not parked.
An agent `take`n (its next request plans to restore it) is never evicted: it leaves
only by `restore` or `drop`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from tokendance.backend.arena import PAGE_BYTES, Arena, Pages
from tokendance.backend.model import KVCache
from tokendance.backend.upload import upload
from tokendance.kernels.restore import gather_slots, scatter_slots


@dataclass(slots=True)
class _Master:
    data: Pages
    nbytes: int
    puts: int = 1  # references held by callers of put_master
    readers: int = 0  # parked agents reading it


@dataclass(slots=True)
class _Parked:
    data: Pages
    nbytes: int
    masters: list[int]
    taken: bool = False  # a request will restore it: not evictable


class HostTier:
    __slots__ = ("cache", "budget", "masters", "agents", "arena", "_bytes")

    def __init__(self, cache: KVCache, budget_bytes: int, page: int | None = None, ranks: int = 1):
        """`budget_bytes` over the `ranks` tensor-parallel ranks that each hold some of a
        token's heads (this one 1/ranks of it); `page`: tokens a host page holds (default:
        2 MiB of K/V of a token's every head: so a rank's tier parks and evicts as one
        process's does)."""
        self.cache = cache
        self.budget = budget_bytes // ranks
        self.masters: dict[int, _Master] = {}
        self.agents: OrderedDict[str, _Parked] = OrderedDict()  # least recently parked first
        kv = cache.kv
        page = page or max(1, PAGE_BYTES // (self.token_bytes() * ranks))
        self.arena = Arena((kv.shape[0], 2, kv.shape[4], kv.shape[5]), kv.dtype, kv.is_cuda,
                           self.budget, page)
        self._bytes = 0

    # -- queries -------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.agents

    def __len__(self) -> int:
        return len(self.agents)

    @property
    def bytes(self) -> int:
        """Host bytes held, each Master once."""
        return self._bytes

    def token_bytes(self) -> int:
        """Host bytes of one token's K/V in every layer."""
        kv = self.cache.kv
        return kv.shape[0] * 2 * kv.shape[4] * kv.shape[5] * kv.element_size()

    # -- offload -------------------------------------------------------------------

    def put_master(self, key: int, slots: torch.Tensor) -> bool:
        """Copy a Master segment's K/V to the host, once per key; a second put only adds
        a reference. False when it cannot fit the budget (then nothing is held)."""
        m = self.masters.get(key)
        if m is not None:
            m.puts += 1
            return True
        need = self._need(slots)
        if not self._room(need, set()):
            return False
        self.masters[key] = _Master(self._to_host(slots), need)
        self._bytes += need
        return True

    def release_master(self, key: int) -> None:
        """Drop one put_master reference; the Master is freed when no one holds it."""
        m = self._master(key, "release_master")
        if m.puts == 0:
            raise ValueError(f"release_master: Master {key} has no put reference left")
        m.puts -= 1
        self._maybe_free(key)

    def park(self, name: str, slots: torch.Tensor, masters: list[int]) -> int:
        """Copy an agent's private K/V at `slots` to the host and hold one reference on
        each Master it reads. Returns the bytes held for it; 0 when it cannot fit the
        budget (then it is not parked, and an earlier entry of the name is dropped)."""
        for key in masters:
            self._master(key, "park")
        masters = list(dict.fromkeys(masters))
        for key in masters:  # taken first: no eviction below may free them
            self.masters[key].readers += 1
        self.drop(name)
        need = self._need(slots)
        if not self._room(need, set(masters)):
            self._release(masters)
            return 0
        self.agents[name] = _Parked(self._to_host(slots), need, masters)
        self._bytes += need
        return need

    def take(self, name: str) -> None:
        """Keep a parked agent until it is restored or dropped: no park evicts it."""
        entry = self.agents.get(name)
        if entry is None:
            raise KeyError(f"take: agent {name!r} is not parked")
        entry.taken = True

    def taken(self, name: str) -> bool:
        """Whether a request plans to restore this parked agent."""
        entry = self.agents.get(name)
        return entry is not None and entry.taken

    def drop(self, name: str) -> None:
        """Forget a parked agent (no-op when it is not parked)."""
        entry = self.agents.pop(name, None)
        if entry is None:
            return
        self._bytes -= entry.nbytes
        self.arena.release(entry.data)
        self._release(entry.masters)

    # -- restore -------------------------------------------------------------------

    def restore(self, items: list[tuple[str, torch.Tensor]], masters: dict[int, torch.Tensor]) -> None:
        """Fused restore of a group: each named agent's private K/V into its destination
        slots, each Master in `masters` into its destination slots once. The agents
        leave the tier (Masters nobody holds any more are freed)."""
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ValueError("restore: an agent is named twice")
        parts: list[tuple[Pages, torch.Tensor]] = []
        for key, dst in masters.items():
            parts.append((self._master(key, "restore").data, dst))
        for name, dst in items:
            entry = self.agents.get(name)
            if entry is None:
                raise KeyError(f"restore: agent {name!r} is not parked")
            parts.append((entry.data, dst))
        for what, (data, dst) in zip([*(f"Master {k}" for k in masters), *names], parts):
            if dst.dim() != 1 or dst.numel() != data.n or dst.is_floating_point():
                raise ValueError(f"restore: {what} holds {data.n} tokens, given "
                                 f"{dst.dtype} destination slots of shape {tuple(dst.shape)}")
        kv = self.cache.kv
        slots = torch.cat([dst.to(torch.long) for _, dst in parts]) if parts else None
        limit = kv.shape[2] * kv.shape[3]
        if slots is not None and not slots.is_cuda and slots.numel() and (
                int(slots.min()) < 0 or int(slots.max()) >= limit):
            raise ValueError(f"restore: destination slots must lie in [0, {limit})")
        if slots is not None and slots.numel():
            stage = torch.empty((slots.numel(), *self.arena.row), dtype=kv.dtype, device=kv.device)
            # One copy per run of pages into device staging: 53 GB/s on the H200 (the
            # link's 55), where packing a pinned host buffer first reached 21 GB/s.
            at = 0
            for data, _ in parts:
                self.arena.read(data, stage[at:at + data.n])
                at += data.n
            scatter_slots(kv, upload(slots, kv.device), stage.permute(1, 2, 0, 3, 4))
        for name in names:
            self.drop(name)

    # -- internals -----------------------------------------------------------------

    def _need(self, slots: torch.Tensor) -> int:
        return self.arena.pages(slots.numel()) * self.arena.page_bytes

    def _room(self, need: int, keep: set[int]) -> bool:
        """Make `need` more bytes fit the budget, evicting least recently parked agents
        that nobody has taken; False, evicting none, when even evicting them all would
        not do. What stays in any case: taken agents, Masters put and still held, and
        the Masters in `keep` or read by a taken agent."""
        taken = [e for e in self.agents.values() if e.taken]
        keep = keep.union(*(e.masters for e in taken))
        floor = sum(m.nbytes for k, m in self.masters.items() if m.puts or k in keep)
        if floor + sum(e.nbytes for e in taken) + need > self.budget:
            return False
        while self._bytes + need > self.budget:
            self.drop(next(n for n, e in self.agents.items() if not e.taken))
        return True

    def _to_host(self, slots: torch.Tensor) -> Pages:
        kv = self.cache.kv
        slots = slots.to(device=kv.device, dtype=torch.long)
        buf = torch.empty((slots.numel(), *self.arena.row), dtype=kv.dtype, device=kv.device)
        gather_slots(kv, slots, buf.permute(1, 2, 0, 3, 4))
        pages = self.arena.alloc(slots.numel())
        self.arena.write(pages, buf)
        return pages

    def _master(self, key: int, op: str) -> _Master:
        m = self.masters.get(key)
        if m is None:
            raise KeyError(f"{op}: Master {key} is not on the host (put_master it first)")
        return m

    def _release(self, keys: list[int]) -> None:
        for key in keys:
            self.masters[key].readers -= 1
            self._maybe_free(key)

    def _maybe_free(self, key: int) -> None:
        m = self.masters[key]
        if not m.puts and not m.readers:
            del self.masters[key]
            self._bytes -= m.nbytes
            self.arena.release(m.data)
