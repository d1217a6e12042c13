"""The round generator: All-Gather (every agent reads every output) and partial
broadcasts (each reads the K outputs after its own), and the compute limit of each."""

from __future__ import annotations

import pytest

from tokendance.bench.allgather import make_round, next_round


def quoted(rnd, i: int) -> list[tuple[int, ...]]:
    return sorted(tuple(rnd.prompts[i][lo:hi]) for lo, hi in rnd.shared[i])


def blocks(rnd) -> dict[int, tuple[int, ...]]:
    """Output j -> its tokens, as every prompt that quotes it has them (all alike)."""
    out: dict[int, tuple[int, ...]] = {}
    for p, spans, reads in zip(rnd.prompts, rnd.shared, rnd.reads):
        for (lo, hi), j in zip(spans, reads):
            assert out.setdefault(j, tuple(p[lo:hi])) == tuple(p[lo:hi])
            assert hi - lo == rnd.outputs[j]
    return out


def test_all_gather_quotes_every_output_in_every_prompt():
    rnd = make_round(5, 30, 12, 1000, seed=3)
    blocks = quoted(rnd, 0)
    assert len(blocks) == 5 and all(quoted(rnd, i) == blocks for i in range(5))
    assert all(sorted(r) == list(range(5)) for r in rnd.reads)
    assert rnd.read_tokens == 5 * rnd.shared_tokens
    private = rnd.prompt_tokens - 5 * rnd.shared_tokens
    assert rnd.limit(0.15) == pytest.approx(private + rnd.shared_tokens + 0.15 * 5 * rnd.shared_tokens)
    # A fan-out of every agent is All-Gather itself, the same round.
    same = make_round(5, 30, 12, 1000, seed=3, fanout=5)
    assert same.prompts == rnd.prompts and same.shared == rnd.shared and same.fanout == 0


@pytest.mark.parametrize("k", [1, 2, 4])
def test_a_fanout_quotes_the_k_outputs_after_each_agent(k: int):
    n = 5
    rnd = make_round(n, 30, 12, 1000, seed=4, fanout=k)
    assert rnd.fanout == k
    for i, reads in enumerate(rnd.reads):
        assert len(rnd.shared[i]) == k
        assert sorted(reads) == sorted((i + d) % n for d in range(1, k + 1))  # never its own
    # Every output read by exactly k agents, the same tokens All-Gather's round quotes
    # (the outputs are drawn first, the same for every fan-out).
    assert sorted(j for r in rnd.reads for j in r) == sorted(list(range(n)) * k)
    assert blocks(rnd) == blocks(make_round(n, 30, 12, 1000, seed=4))
    assert rnd.read_tokens == k * rnd.shared_tokens
    private = rnd.prompt_tokens - rnd.read_tokens
    assert rnd.limit(0.2) == pytest.approx(private + rnd.shared_tokens + 0.2 * k * rnd.shared_tokens)


def test_next_round_keeps_the_fanout():
    r1 = make_round(4, 20, 10, 1000, seed=1, fanout=2)
    r2 = next_round(r1, [[7, 8]] * 4, 10, 1000, seed=2)
    assert r2.fanout == 2
    assert all(len(s2) == len(s1) + 2 for s1, s2 in zip(r1.shared, r2.shared))
    assert len(r2.outputs) == 8 and blocks(r2)  # old outputs 0-3, new 4-7, quoted alike
    assert [sorted(r[2:]) for r in r2.reads] == [sorted(4 + (i + d) % 4 for d in (1, 2)) for i in range(4)]


@pytest.mark.parametrize("k", [-1, 6])
def test_a_fanout_out_of_range_is_refused(k: int):
    with pytest.raises(ValueError, match="out of range for 5 agents"):
        make_round(5, 20, 10, 1000, fanout=k)
