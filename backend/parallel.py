"""Tensor parallelism: one process per device, each holding 1/n of every layer's heads
and MLP width and of the vocabulary, all running the same engine in lockstep.

The split is Megatron's: qkv_proj and gate_up_proj by output rows (a rank's query and KV
heads, its share of the MLP), o_proj and down_proj by input columns, their partial
outputs summed across ranks (one all-reduce after attention, one after the MLP); the
embeddings and lm_head by vocabulary rows (a token's embedding summed from the rank that
holds it, the logits gathered whole on every rank); norms whole, and a mixture of experts'
router (each expert splits as a dense MLP does). A rank's KV pool holds its own KV heads
only, so the pool, the segment cache, the Mirrors and the host tier all shrink by n per
token while their block tables stay the same on every rank.

The engine's schedule is a function of the calls made to it (add, abort, step,
reset_caches) and nothing else: no clock, no memory reading once it is built. So rank 0,
the leader (the process that built the Engine), sends each call to the others, the
followers, which make it too, and every rank schedules, blends and samples alike. Where
the engine decides from K/V values (the check layer's deviations, diff encode's
equality, kvcomm's nearest anchors) each rank's partial values are reduced first, so
every rank decides the same. Logits are the same on every rank (an all-reduce hands each
rank the same sums, an all-gather the same columns) and so are sampled tokens; followers
hash what they produce, and the leader compares the hashes with its own when the engine
closes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import hashlib
import os
import pickle
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokendance.backend.api import Delta, InvalidRequest
from tokendance.backend.config import EngineConfig, ModelConfig

if TYPE_CHECKING:
    from tokendance.backend.engine import Engine

log = structlog.get_logger(__name__)
T = TypeVar("T")

# Every rank reaches the rendezvous by then (a follower only imports torch first), and
# waits no longer for the others inside a collective (they run in lockstep).
JOIN_TIMEOUT = timedelta(minutes=2)
IDLE = timedelta(days=365)  # followers wait this long for the leader's next call
_joined: Shard | None = None  # this process's shard, set while a TP engine lives here
# torch 2.13 renamed it (the GPU machine's 2.11 has the old name only)
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# For checks on a machine of one GPU (bench/check_cuda.py): every rank on the engine's
# device, gloo between them (which CUDA graphs cannot capture: run them with cuda_graphs=0).
ONE_DEVICE = "TOKENDANCE_TP_ONE_DEVICE"


@dataclass(eq=False)
class Shard:
    """This process's place in a tensor-parallel group, and the collectives the model
    and the engine's reuse decisions need."""

    rank: int
    size: int
    device: torch.device
    group: Any  # tensors: NCCL on CUDA, gloo on the CPU
    calls: Any  # the leader's calls to the followers, and small host values: gloo
    procs: list[BaseProcess] = field(default_factory=list)  # the leader's followers
    digest: Any = field(default_factory=hashlib.sha256)  # what this rank's steps produced
    agreed: bool | None = None  # the leader, once closed: did every rank produce the same

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """x's elementwise maximum over the ranks, in place."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n] on each rank -> [T, size * n]: every rank's columns side by side, in rank order."""
        out = torch.empty((self.size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        _gather(out, x.contiguous(), group=self.group)
        return out.view(self.size, *x.shape).movedim(0, 1).flatten(1)

    def rows(self, n: int) -> int:
        """This rank's share of n rows, the last share padded (the vocabulary)."""
        return -(-n // self.size)

    def least(self, n: int) -> int:
        """The smallest of every rank's n (sizes each rank measured on its own device)."""
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.calls)
        return int(t.item())

    def gone(self) -> str | None:
        """The leader's view: which follower has exited, if one has."""
        for p in self.procs:
            if not p.is_alive():
                return f"tensor-parallel rank {p.name} exited (code {p.exitcode})"
        return None

    def note(self, out: list[tuple[str, Delta]]) -> None:
        for rid, d in out:
            self.digest.update(f"{rid}:{d.token_ids}:{d.finish_reason};".encode())


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The part of the model one rank holds (InvalidRequest if the model cannot split so)."""
    if cfg.qk_norm == "all":
        raise InvalidRequest("the model norms q and k over all its heads at once (OLMo 2, OLMoE): it does not "
                             "split over tensor-parallel ranks", "tensor_parallel_size")
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP width", cfg.intermediate_size), ("experts' MLP width", cfg.expert_size or size),
                    ("shared expert's MLP width", cfg.shared_expert_size or size)):
        if n % size:
            raise InvalidRequest(f"--tensor-parallel-size {size} does not divide the model's "
                                 f"{n} {what}", "tensor_parallel_size")
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=cfg.num_kv_heads // size,
                               intermediate_size=cfg.intermediate_size // size, expert_size=cfg.expert_size // size,
                               shared_expert_size=cfg.shared_expert_size // size)


ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split by output rows
COLUMNS = ("o_proj", "down_proj")  # by input columns
VOCAB = ("embed_tokens", "lm_head")  # by vocabulary rows, the last rank's padded


def shard_weight(name: str, w: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """A checkpoint tensor's part on this rank (heads stay whole: the model's head counts
    divide by the group's size; the vocabulary's last share may hold fewer rows than the
    others)."""
    if shard is None or shard.size == 1:
        return w
    if any(name.startswith(p) or f".{p}." in name for p in VOCAB):
        rows = shard.rows(w.shape[0])
        return w[shard.rank * rows:(shard.rank + 1) * rows]
    if any(f".{p}." in name for p in ROWS):
        return w.chunk(shard.size, 0)[shard.rank]
    if any(f".{p}." in name for p in COLUMNS) and name.endswith(".weight"):
        return w.chunk(shard.size, 1)[shard.rank]
    return w


def shard_for(cfg: EngineConfig, device: torch.device, model: ModelConfig) -> Shard | None:
    """A new Engine's shard: a follower's (joined before its Engine was built), else the
    leader's: started here, cfg.tensor_parallel_size - 1 followers each building the same
    Engine on the next device; None without tensor parallelism."""
    if _joined is not None and _joined.rank > 0:
        return _joined
    size = cfg.tensor_parallel_size
    if size < 1:
        raise InvalidRequest(f"--tensor-parallel-size must be at least 1, got {size}", "tensor_parallel_size")
    if size == 1:
        return None
    shard_config(model, size)  # before any process starts
    if _joined is not None:
        raise InvalidRequest("one tensor-parallel engine per process: close the other first",
                             "tensor_parallel_size")
    if device.type == "cuda" and (_device(device, size - 1).index or 0) >= torch.cuda.device_count():
        raise InvalidRequest(f"--tensor-parallel-size {size} from {device} needs more GPUs than "
                             f"the {torch.cuda.device_count()} here", "tensor_parallel_size")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follow, args=(cfg, rank, size, port), daemon=True,
                         name=f"tokendance-tp{rank}") for rank in range(1, size)]
    for p in procs:
        p.start()
    try:
        shard = _join(0, size, port, device, procs)
    except Exception:
        for p in procs:
            p.kill()
        raise
    shard.procs = procs
    log.info("tensor parallel", size=size, devices=[str(_device(device, r)) for r in range(size)])
    return shard


def _device(device: torch.device, rank: int) -> torch.device:
    """Rank's device, with its index (torch.cuda.set_device refuses a bare "cuda")."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + (0 if os.environ.get(ONE_DEVICE) else rank))


def free_port() -> int:
    """A loopback port free now (a rendezvous's, a server's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, size: int, port: int, device: torch.device, procs: list[BaseProcess] = ()) -> Shard:
    """Join the group: the leader (with its followers' `procs`) hosts the rendezvous and
    waits for each follower to report, failing as soon as one exits instead."""
    global _joined
    dev = _device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif "OMP_NUM_THREADS" not in os.environ:  # the CPU's cores, split between the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=JOIN_TIMEOUT,
                          wait_for_workers=False)
    if rank:
        store.set(f"up{rank}", "1")
    end = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    while procs and not store.check([f"up{p}" for p in range(1, size)]):
        for p in procs:
            if not p.is_alive():
                raise ChildProcessError(f"tensor-parallel rank {p.name} exited (code {p.exitcode}) before "
                                        "it joined; its output says why")
        if time.monotonic() > end:
            raise TimeoutError(f"tensor-parallel ranks did not join within {JOIN_TIMEOUT}")
        time.sleep(0.05)
    backend = "nccl" if dev.type == "cuda" and not os.environ.get(ONE_DEVICE) else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=JOIN_TIMEOUT)
    calls = dist.new_group(backend="gloo", timeout=IDLE)
    _joined = Shard(rank, size, dev, dist.group.WORLD, calls)
    if backend == "nccl":  # its communicator made now: a decode graph's capture cannot
        _joined.sum(torch.zeros(1, device=dev))
    return _joined


STEP = pickle.dumps(("step", ()))  # every step's call, packed once


class Relay:
    """The leader's end: the calls made to its Engine, sent to the followers before each
    step (a step runs collectives every rank must join)."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.pending: list[bytes] = []
        atexit.register(self.close)

    def call(self, name: str, *args: Any) -> None:
        """Queue a call for the next step."""
        self.queue(self.pack(name, *args))

    @staticmethod
    def pack(name: str, *args: Any) -> bytes:
        """A call as it travels, pickled now: the engine may change its arguments (a
        request's sampling, say) before the next step."""
        return pickle.dumps((name, args))

    def queue(self, call: bytes) -> None:
        self.pending.append(call)

    def step(self, run: Callable[[], T]) -> T:
        """Send the step to the followers, then `run` it here. A collective that fails
        because a follower died (gloo sees its socket close) says which one did."""
        self.queue(STEP)
        self._send(self.pending)
        try:
            return run()
        except RuntimeError as e:
            for _ in range(40):  # its exit reaches us a moment after its socket's reset
                gone = self.shard.gone()
                if gone:
                    raise ChildProcessError(gone) from e
                time.sleep(0.05)
            raise

    def close(self, clean: bool = True) -> bool | None:
        """Stop the followers; whether every rank produced the same (None if not known).
        `clean`: they wait for the call (else, the engine failing to build, they go)."""
        global _joined
        sh = self.shard
        if _joined is not sh:
            return sh.agreed
        try:
            if clean:
                self._send([pickle.dumps(("close", ()))])
                digests: list[Any] = [None] * sh.size
                dist.gather_object(sh.digest.hexdigest(), digests, dst=0, group=sh.calls)
                sh.agreed = len(set(digests)) == 1
                if not sh.agreed:
                    log.error("tensor-parallel ranks produced different tokens", digests=digests)
        except (RuntimeError, ChildProcessError) as e:  # a follower already gone
            log.error("tensor-parallel close", error=str(e))
        for p in sh.procs:
            p.join(timeout=30 if clean else 0)
            if p.is_alive():
                p.kill()
                p.join()
        dist.destroy_process_group()
        _joined = None
        atexit.unregister(self.close)
        return sh.agreed

    def _send(self, calls: list[bytes]) -> None:
        gone = self.shard.gone()
        if gone:
            raise ChildProcessError(gone)
        dist.broadcast_object_list([calls], src=0, group=self.shard.calls)
        self.pending = []


def subordinate() -> None:
    """Set up a process an engine's parent started (a follower, a data-parallel engine): it
    goes when its parent goes (Linux's PR_SET_PDEATHSIG), leaves a terminal's ^C to the
    parent, which stops it in order, and logs only what fails (the parent tells how the
    engine stands)."""
    with contextlib.suppress(AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from tokendance.backend import logs

    logs.to_stderr("warning")


def _follow(cfg: EngineConfig, rank: int, size: int, port: int) -> None:
    """A follower process: build the Engine's shard, then make the leader's calls."""
    subordinate()
    from tokendance.backend.device import pick_device
    from tokendance.backend.engine import Engine

    shard = _join(rank, size, port, pick_device(cfg.device))
    follow(Engine(cfg), shard)


def follow(engine: Engine, shard: Shard) -> None:
    """Make the leader's calls until it closes (the engine notes what its steps produce)."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=shard.calls)
        for name, args in map(pickle.loads, box[0]):
            if name == "close":
                dist.gather_object(shard.digest.hexdigest(), None, dst=0, group=shard.calls)
                dist.destroy_process_group()
                return
            try:
                getattr(engine, name)(*args)
            except Exception:  # the leader's call failed alike: it aborts what ran, and so will we
                log.exception("tensor-parallel follower: a call failed", call=name, rank=shard.rank)
