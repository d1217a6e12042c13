"""A Mirror's layout on its own: which slot each token's K/V takes in each view, and the
positions its attention table gives every slot."""

from __future__ import annotations

import torch

from tokendance.backend.mirror import EARLY, LATE, Mirror, Span

B = 4


def layout(dense_early: bool = False) -> tuple[Mirror, list[bool]]:
    """Prompt of 14 tokens: private 0-2, segment A at 3-7 (Master blocks 10, 11), private
    8, segment B at 9-12 (Master block 20), the last token 13 private."""
    reused = [False] * 3 + [True] * 5 + [False] + [True] * 4 + [False]
    spans = [Span([10, 11], 3, 5), Span([20], 9, 4)]
    return Mirror.build(14, spans, reused, dense_early, patch_cap=2), reused


def test_private_tokens_then_patch_room():
    m, _ = layout()
    assert [m.own_slot(j, EARLY) for j in (0, 1, 2, 8, 13)] == [0, 1, 2, 3, 4]
    assert m.area == 7  # five own tokens, two patch slots
    assert all(m.own_slot(j, v) == -1 for j in (3, 7, 9, 12) for v in (EARLY, LATE))
    assert m.own_slots(14) == 7 and m.own_slots(17) == 10  # three generated tokens
    assert m.held(17) == 8  # the two patch slots are unused until picked
    assert m.own_slot(15, EARLY) == m.own_slot(15, LATE) == 8  # generated: both views


def test_picked_tokens_are_private_in_the_late_view_only():
    m, _ = layout()
    m.pick([5, 10])
    assert m.own_slot(5, LATE) == 5 and m.own_slot(10, LATE) == 6
    assert m.own_slot(5, EARLY) == -1 and m.own_slot(10, EARLY) == -1  # layer 0: the Master
    assert m.held(14) == 7
    rows = torch.arange(14)
    assert m.own_index(LATE, rows).tolist() == [m.own_slot(j, LATE) for j in range(14)]


def test_table_positions():
    m, _ = layout()
    m.pick([5, 10])
    own_blocks = [1, 2]  # 8 private slots: 7 of prompt area, 1 for the first generated token
    for view in (EARLY, LATE):
        blocks, pos = m.table(view, own_blocks, B)
        assert blocks.tolist() == [1, 2, 10, 11, 20]
        own = pos[:8].tolist()
        assert own[:5] == [0, 1, 2, 8, 13] and own[7] == 14
        master_a, master_b = pos[8:16].tolist(), pos[16:20].tolist()
        if view == EARLY:
            assert own[5:7] == [-1, -1]
            assert master_a == [3, 4, 5, 6, 7, -1, -1, -1] and master_b == [9, 10, 11, 12]
        else:  # the picked tokens move to their patches, their Master slots hide
            assert own[5:7] == [5, 10]
            assert master_a == [3, 4, -1, 6, 7, -1, -1, -1] and master_b == [9, -1, 11, 12]


def test_master_slots_and_a_segment_token_that_is_not_reused():
    reused = [False] * 3 + [True] * 4 + [False]  # segment at 3-7, but token 7 is the last
    m = Mirror.build(8, [Span([10, 11], 3, 5)], reused, False, patch_cap=1)
    assert m.master_slots(B).tolist() == [-1, -1, -1, 40, 41, 42, 43, -1]
    _, pos = m.table(EARLY, [1, 2], B)  # 5 slots of prompt area, then generated tokens
    assert pos[:8].tolist() == [0, 1, 2, 7, -1, 8, 9, 10]
    assert pos[8:].tolist() == [3, 4, 5, 6, -1, -1, -1, -1]  # token 7 reads its own slot
    assert m.own_slot(7, EARLY) == 3


def test_dense_early_view_for_a_later_check_layer():
    m, reused = layout(dense_early=True)
    assert m.area == 14  # every prompt token has a private slot
    assert all(m.own_slot(j, EARLY) == j for j in range(14))
    assert all(m.own_slot(j, LATE) == (-1 if reused[j] else j) for j in range(14))
    m.pick([4])
    assert m.own_slot(4, LATE) == 4 and m.held(14) == 14


def test_master_read_of_a_batch():
    """backend/tables.master_read: each segment once, a shift per Mirror and chunk, and
    hidden slots per view; a plain sequence and a Mirror without spans read nothing."""
    from tokendance.backend.api import SamplingParams
    from tokendance.backend.detok import Detok
    from tokendance.backend.sequence import Sequence
    from tokendance.backend.tables import master_read
    from tokendance.kernels.master import NOT_READ

    def seq(mirror):
        s = Sequence("s", [1] * 14, SamplingParams(), Detok(None))
        s.mirror = mirror
        return s

    m, _ = layout()
    m.pick([5])
    # The same two segments, in the other order, at other offsets.
    other = Mirror.build(12, [Span([20], 1, 4), Span([10, 11], 6, 5)],
                         [False] + [True] * 4 + [False] + [True] * 5 + [False], False, 1)
    bare = Mirror.build(5, [], [False] * 5, False, 0)
    read = master_read([seq(m), seq(None), seq(other), seq(bare)], LATE, B, chunks=1)
    assert read.table.tolist() == [10, 11, 20]
    assert read.chunks.tolist() == [[0, 5, 0], [8, 12, 8]]  # one chunk a segment
    assert read.shift.tolist() == [[3, 9], [NOT_READ] * 2, [6, 1], [NOT_READ] * 2]
    hidden = [[j for j in range(12) if read.hide[s, j]] for s in range(4)]
    # Mirror 0 hides its patch (token 5: segment A slot 2) and the blocks' unused ends.
    assert hidden[0] == [2, 5, 6, 7]
    assert hidden[2] == [5, 6, 7]
    early = master_read([seq(m)], EARLY, B, chunks=1)
    assert [j for j in range(12) if early.hide[0, j]] == [5, 6, 7]  # layer 0 reads the patch's base
    assert master_read([seq(bare)], LATE, B).chunks.shape == (0, 3)


def test_vectorised_tables_equal_the_token_by_token_definition():
    g = torch.Generator().manual_seed(5)
    for trial in range(20):
        n, spans, reused, lo = 60, [], [False] * 60, 2
        while lo < 50:  # segments of 3-9 tokens with private gaps, some tokens not reused
            size = int(torch.randint(3, 10, (1,), generator=g))
            spans.append(Span(list(range(100 + 10 * len(spans), 100 + 10 * len(spans) + 3)), lo, size))
            for t in range(lo, lo + size):
                reused[t] = bool(torch.rand(1, generator=g) < 0.9)
            lo += size + int(torch.randint(0, 4, (1,), generator=g))
        m = Mirror.build(n, spans, reused, trial % 4 == 0, patch_cap=6)
        picked = [j for j in range(n) if reused[j]]
        m.pick(picked[:: max(1, len(picked) // 5)][:5])
        for view in (EARLY, LATE):
            rows = torch.arange(n + 3)  # and three generated tokens
            assert m.own_index(view, rows).tolist() == [m.own_slot(int(j), view) for j in rows]
            want = []
            for sp in spans:
                pos = [-1] * (len(sp.blocks) * B)
                for t in range(sp.n):
                    j = sp.lo + t
                    if reused[j] and m.own_slot(j, view) < 0:
                        pos[t] = j
                want += pos
            assert m.master_pos(view, B).tolist() == want
        slots = [-1] * n
        for sp in spans:
            for t in range(sp.n):
                if reused[sp.lo + t]:
                    slots[sp.lo + t] = sp.blocks[t // B] * B + t % B
        assert m.master_slots(B).tolist() == slots


def test_a_resumed_mirror_keeps_the_parked_patches():
    from tokendance.backend.idle import Parked, Resume, resumed_mirror

    for dense_early in (False, True):
        old, reused = layout(dense_early)
        old.pick([5, 10])
        parked = Parked([0] * 14, old, old.area)
        # The first 12 tokens come back; 8 new ones follow (4 of them a new segment).
        new = resumed_mirror(Resume("a", parked, 12), 20, old.spans, [Span([30], 14, 4)],
                             [False, False] + [True] * 4 + [False, False], dense_early, 0.5)
        assert new.reused.tolist() == reused[:12] + [False, False] + [True] * 4 + [False, False]
        late = [j for j in range(20) if new.reused[j] and new.own_slot(j, LATE) >= 0]
        assert late == [5, 10]  # the old patches, and none of the new segment's yet
        assert new.own_slot(5, EARLY) == (5 if dense_early else -1)
        assert len(new.patch_free) == (0 if dense_early else 2)  # ceil(0.5 * 4) for the new one


def test_store_slots_without_reads():
    """kv_view(reads=False), for attention over the step's own K/V: the same store slots
    as the full view, and no tables."""
    from tokendance.backend.api import SamplingParams
    from tokendance.backend.detok import Detok
    from tokendance.backend.sequence import Sequence
    from tokendance.backend.tables import kv_view

    seqs = []
    for mirror in (layout()[0], None):
        s = Sequence("s", [1] * 14, SamplingParams(), Detok(None))
        s.mirror, s.blocks = mirror, [3, 7, 9, 4]
        seqs.append(s)
    rows = [torch.arange(14), torch.arange(2, 14)]
    for view in (EARLY, LATE):
        full = kv_view(seqs, rows, view, B, trash=99, device="cpu")
        bare = kv_view(seqs, rows, view, B, trash=99, device="cpu", reads=False)
        assert torch.equal(bare["slots"], full["slots"]) and (bare["slots"] == 99).sum() == 9
        assert bare["block_tables"].shape == (2, 0) and "slot_pos" not in bare
