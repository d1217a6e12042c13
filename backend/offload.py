"""The host tier: idle agents' KV in host memory, restored fused.

Between rounds an idle agent is a Mirror: it reads the round's shared segments from
Master blocks and owns private slots for its own tokens and patches. Offloading it
keeps that split: each Master segment goes to the host once (`put_master`), each agent
only its private slots (`park`). `restore` brings a group back in one host-to-device
copy per entry into one device staging buffer and ONE `scatter_slots` launch: every
Master once, each agent's private slots, written straight into fresh pool slots (no
dense copy of any agent is ever built).

A vLLM-style dense tier is the same API with no Masters and every token private.

Host entries are [n, layers, 2, Hkv, D] (pinned when the pool is on CUDA), so an entry
is one contiguous range and the staging buffer their concatenation along n. Copies run
on the current stream without host syncs: a host entry is complete in stream order,
which is all a later restore on the same stream needs (read one on the CPU only after
torch.cuda.synchronize()).

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

from tokendance.backend.model import KVCache
from tokendance.kernels.restore import gather_slots, scatter_slots


@dataclass(slots=True)
class _Master:
    data: torch.Tensor  # host [n, layers, 2, Hkv, D]
    puts: int = 1  # references held by callers of put_master
    readers: int = 0  # parked agents reading it

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class _Parked:
    data: torch.Tensor  # host [n, layers, 2, Hkv, D]
    masters: list[int]
    taken: bool = False  # a request will restore it: not evictable

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class HostTier:
    __slots__ = ("cache", "budget", "masters", "agents", "_bytes", "_pin")

    def __init__(self, cache: KVCache, budget_bytes: int):
        self.cache = cache
        self.budget = budget_bytes
        self.masters: dict[int, _Master] = {}
        self.agents: OrderedDict[str, _Parked] = OrderedDict()  # least recently parked first
        self._bytes = 0
        self._pin = cache.kv.is_cuda

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

    def put_master(self, key: int, slots: torch.Tensor) -> None:
        """Copy a Master segment's K/V to the host, once per key; a second put only adds
        a reference."""
        m = self.masters.get(key)
        if m is not None:
            m.puts += 1
            return
        m = self.masters[key] = _Master(self._to_host(slots))
        self._bytes += m.nbytes

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
        need = slots.numel() * self.token_bytes()
        # What stays if every agent that may be evicted went: taken agents, Masters put
        # and still held, the ones this agent or a taken one reads.
        taken = [e for e in self.agents.values() if e.taken]
        keep = set(masters).union(*(e.masters for e in taken))
        floor = sum(m.nbytes for k, m in self.masters.items() if m.puts or k in keep)
        if floor + sum(e.nbytes for e in taken) + need > self.budget:
            self._release(masters)
            return 0
        while self._bytes + need > self.budget:
            self.drop(next(n for n, e in self.agents.items() if not e.taken))
        entry = self.agents[name] = _Parked(self._to_host(slots), masters)
        self._bytes += entry.nbytes
        return entry.nbytes

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
        self._release(entry.masters)

    # -- restore -------------------------------------------------------------------

    def restore(self, items: list[tuple[str, torch.Tensor]], masters: dict[int, torch.Tensor]) -> None:
        """Fused restore of a group: each named agent's private K/V into its destination
        slots, each Master in `masters` into its destination slots once. The agents
        leave the tier (Masters nobody holds any more are freed)."""
        names = [name for name, _ in items]
        if len(set(names)) != len(names):
            raise ValueError("restore: an agent is named twice")
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for key, dst in masters.items():
            parts.append((self._master(key, "restore").data, dst))
        for name, dst in items:
            entry = self.agents.get(name)
            if entry is None:
                raise KeyError(f"restore: agent {name!r} is not parked")
            parts.append((entry.data, dst))
        for what, (data, dst) in zip([*(f"Master {k}" for k in masters), *names], parts):
            if dst.dim() != 1 or dst.numel() != data.shape[0] or dst.is_floating_point():
                raise ValueError(f"restore: {what} holds {data.shape[0]} tokens, given "
                                 f"{dst.dtype} destination slots of shape {tuple(dst.shape)}")
        kv = self.cache.kv
        slots = torch.cat([dst.to(torch.long) for _, dst in parts]) if parts else None
        limit = kv.shape[2] * kv.shape[3]
        if slots is not None and not slots.is_cuda and slots.numel() and (
                int(slots.min()) < 0 or int(slots.max()) >= limit):
            raise ValueError(f"restore: destination slots must lie in [0, {limit})")
        if slots is not None and slots.numel():
            stage = torch.empty((slots.numel(), *parts[0][0].shape[1:]), dtype=kv.dtype,
                                device=kv.device)
            # One copy per entry into device staging: 53 GB/s on the H200 (the link's
            # 55), where packing a pinned host buffer first reached 21 GB/s.
            at = 0
            for data, _ in parts:
                stage[at:at + data.shape[0]].copy_(data, non_blocking=True)
                at += data.shape[0]
            slots = slots.to(kv.device, non_blocking=True)
            scatter_slots(kv, slots, stage.permute(1, 2, 0, 3, 4))
        for name in names:
            self.drop(name)

    # -- internals -----------------------------------------------------------------

    def _to_host(self, slots: torch.Tensor) -> torch.Tensor:
        kv = self.cache.kv
        slots = slots.to(device=kv.device, dtype=torch.long)
        n = slots.numel()
        shape = (n, kv.shape[0], 2, kv.shape[4], kv.shape[5])
        buf = torch.empty(shape, dtype=kv.dtype, device=kv.device)
        gather_slots(kv, slots, buf.permute(1, 2, 0, 3, 4))
        if not kv.is_cuda:
            return buf
        host = torch.empty(shape, dtype=kv.dtype, pin_memory=self._pin)
        host.copy_(buf, non_blocking=True)
        return host

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
