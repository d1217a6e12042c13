"""Which batch sizes get a decode graph (backend/graphs.py); replays themselves are
checked on the GPU (bench/check_cuda.py)."""

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
