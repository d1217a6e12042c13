"""`usage` reports what happened to a request, whichever path its prompt took."""

from __future__ import annotations

import torch

from tokendance.backend.api import SamplingParams, Usage
from tokendance.backend.engine import Engine


def _usage(eng: Engine, prompt: list[int], mode: str, shared: list[tuple[int, int]]) -> tuple[list[int], Usage]:
    eng.add(mode, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), mode=mode, shared=shared)
    toks, usage = [], None
    while eng.has_work():
        for _, d in eng.step():
            toks += d.token_ids
            usage = d.usage or usage
    return toks, usage


def test_a_reuse_request_prefilled_plainly_still_reports_its_shared_tokens(tiny_llama):
    """A pool of four blocks holds the 63-token prompt, but not its 48-token segment's
    base (three blocks) beside its Mirror (two): the request is prefilled plainly, as
    full mode would. Its prompt still holds 48 shared tokens, and says so as full's
    does; none of them was reused."""
    prompt = torch.randint(3, 49152, (63,), generator=torch.Generator().manual_seed(3)).tolist()
    shared = [(7, 55)]
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=64, segment_cache_fraction=1.0)
    full = _usage(eng, prompt, "full", shared)
    got = _usage(eng, prompt, "pic", shared)
    assert got[0] == full[0]
    assert got[1].shared_tokens == full[1].shared_tokens == 48
    assert got[1].cached_tokens == got[1].recomputed_tokens == 0
    eng.reset_caches()
    assert eng.pool.num_free == eng.cache.num_blocks
