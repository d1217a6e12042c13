"""Which batch sizes get a decode graph (backend/graphs.py), and decode steps no graph
replays; replays themselves are checked on the GPU (bench/check_cuda.py)."""

import structlog

from tokendance.backend.api import SamplingParams
from tokendance.backend.engine import Engine
from tokendance.backend.graphs import buckets


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    sizes = buckets(128)
    assert sizes[-1] == 128 and all(b - a <= 8 for a, b in zip(sizes[3:], sizes[4:]))
    for n in range(1, 129):  # a batch pads to the next size: fewer than 8 rows, fewer than n
        pad = next(b for b in sizes if b >= n) - n
        assert pad < 8 and (pad < n or n > 8)


def test_decode_steps_no_graph_replays_are_counted_and_warned_once(tiny_llama):
    """Without a graph a decode step on CUDA is several times slower (Mirrors reading 48
    segments once made a round 3x longer): /metrics counts such steps, the log says so once."""
    eng = Engine(model=str(tiny_llama), dtype="float32", kv_tokens=2048)

    class NoFit:  # the CPU captures no graphs: stand in for ones that do not fit
        def fits(self, work) -> bool:
            return False

    eng.runner.graphs = NoFit()
    with structlog.testing.capture_logs() as logs:
        eng.add("a", list(range(5, 40)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while eng.has_work():
            eng.step()
    assert eng.runner.eager_decodes == 3  # the prefill samples the first token
    warned = [e for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1 and "without a CUDA graph" in warned[0]["event"]
