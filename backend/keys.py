"""Content keys of cached KV: 128-bit BLAKE2b digests of token ids in a tenant's namespace.

Both caches that hand KV computed for one request to another find it by key: the
segment cache (a shared segment's tokens) and prefix caching (a chain over the full
blocks of a prompt). A hit must mean the same tokens, after the same prefix, for the
same tenant. Python's `hash()` of a tuple of ints is neither keyed nor collision
resistant, so a client could craft tokens whose key equals another's and be served that
KV or poison it; vLLM's prefix cache moved to sha256 for the same reason. The tenant
(the proxy passes a digest of the API key) starts every chain, so no request ever hits
KV another API key computed, nor learns from its latency that such KV exists. The
model is in every key by construction: each engine (one model, one dtype) keeps its own
caches, and they live as long as it does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from functools import lru_cache

Key = bytes
SIZE = 16


@lru_cache(maxsize=1024)
def namespace(tenant: str, kind: str) -> Key:
    """Where a tenant's chain of `kind` ("prefix" | "segment") starts."""
    return hashlib.blake2b(tenant.encode("utf-8", "surrogatepass"), digest_size=SIZE,
                           person=kind.encode()).digest()


def chain(prev: Key, ids: Sequence[int]) -> Key:
    """The key of `ids` following the tokens whose key is `prev`."""
    h = hashlib.blake2b(prev, digest_size=SIZE)
    h.update(array("q", ids).tobytes())
    return h.digest()


def chained(prev: Key, ids: Sequence[int], size: int) -> Iterator[Key]:
    """The keys of the full `size`-token blocks of `ids`, following `prev`, in order."""
    data = memoryview(array("q", ids).tobytes())
    step = 8 * size
    for lo in range(0, len(data) - step + 1, step):
        h = hashlib.blake2b(prev, digest_size=SIZE)
        h.update(data[lo:lo + step])
        prev = h.digest()
        yield prev


def segment_key(tenant: str, ids: Sequence[int]) -> Key:
    """A shared segment's key, independent of its position in any prompt."""
    return chain(namespace(tenant, "segment"), ids)
