import random
import signal
import time

from tokendance.backend.api import Segment
from tokendance.proxy import segment as sg
from tokendance.proxy.known import Known
from tokendance.proxy.segment import SEP, escape, unescape

# Pieces that stress the escape: the separator, its parts, the escape itself.
PIECES = [SEP, "<|td", "~", "-sep|>", "<|td~", "<", "|", ">", "td", "a", " ", "\n", escape(SEP)]


def noise(rng: random.Random, k: int = 8) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, k)))


def render(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"


def pairs(segs: list[Segment]) -> list[tuple[str, bool]]:
    return [(s.text, s.shared) for s in segs]


def test_escape_never_contains_sep_and_inverts_exactly():
    rng = random.Random(0)
    for _ in range(3000):
        t = noise(rng, 12)
        assert SEP not in escape(t)
        assert unescape(escape(t)) == t


def test_flatten_round_trips_any_text():
    rng = random.Random(1)
    for _ in range(1000):
        segs, shared = [], rng.random() < 0.5
        for _ in range(rng.randint(1, 6)):
            text = noise(rng) or "x"
            segs.append(Segment(text, shared))
            shared = True if not shared else rng.random() < 0.5  # no two private in a row
        flat = sg.flatten(segs)
        assert pairs(sg.unflatten(flat)) == pairs(segs)


def test_blocks_between_separators_are_shared():
    assert sg.blocks(f"intro{SEP}A{SEP}B{SEP}outro") == [
        ("intro", False), ("A", True), ("B", True), ("outro", False)]
    assert sg.blocks(f"{SEP}A{SEP}") == [("A", True)]
    assert sg.blocks(f"only{SEP}one") == [("only", False), ("one", False)]
    assert sg.blocks("plain") == [("plain", False)]


def test_escaped_separator_neither_creates_nor_hides_a_boundary():
    # A literal separator written escaped stays text inside its block ...
    assert sg.blocks(f"{SEP}has {escape(SEP)} inside{SEP}") == [(f"has {SEP} inside", True)]
    # ... and text ending in the escape's prefix cannot swallow a real separator.
    assert sg.blocks(f"x<|td{SEP}A{SEP}y<|td~") == [("x<|td", False), ("A", True), ("y<|td", False)]


def test_chat_without_separators_takes_content_literally():
    messages = [{"role": "user", "content": f"look {SEP}not a block{SEP} here"}]
    segs = sg.chat(render, messages, explicit=False, known=Known())
    assert pairs(segs) == [(render(messages), False)]


def test_chat_with_separators_marks_each_block():
    messages = [{"role": "system", "content": "sys"},
                {"role": "user", "content": f"Answers:{SEP}ans one{SEP}ans two{SEP}Reply."}]
    segs = sg.chat(render, messages, explicit=True, known=Known())
    assert pairs(segs) == [("<system>sys</><user>Answers:", False), ("ans one", True),
                           ("ans two", True), ("Reply.</><assistant>", False)]


def test_chat_segments_cover_the_rendered_prompt_exactly():
    rng = random.Random(2)
    for _ in range(300):
        messages = [{"role": rng.choice(["user", "assistant"]), "content": noise(rng, 10)}
                    for _ in range(rng.randint(1, 4))]
        known = {noise(rng, 4) or "zz": ("s", "a", 1) for _ in range(2)}
        plain = [{**m, "content": "".join(t for t, _ in sg.blocks(m["content"]))} for m in messages]
        segs = sg.chat(render, messages, explicit=True, known=Known.of(known))
        assert "".join(s.text for s in segs) == render(plain)
        assert all(s.text for s in segs)
        assert all(a.shared or b.shared for a, b in zip(segs, segs[1:]))  # private runs merged


def test_template_that_drops_content_falls_back_to_private():
    def drop_system(ms):
        return render([m for m in ms if m["role"] != "system"])

    messages = [{"role": "system", "content": f"{SEP}gone{SEP}"}, {"role": "user", "content": "hi"}]
    segs = sg.chat(drop_system, messages, explicit=True, known=Known())
    assert pairs(segs) == [("<user>hi</><assistant>", False)]


def test_detect_marks_every_occurrence_of_known_outputs():
    p1, p2 = ("s", "a", 1), ("s", "b", 1)
    known = {"the answer is forty two": p1, "blue sky all day long": p2}
    text = "A said: the answer is forty two. B said: blue sky all day long. Again: the answer is forty two"
    segs = sg.detect([Segment(text)], Known.of(known))
    assert [(s.text, s.producer) for s in segs if s.shared] == [
        ("the answer is forty two", p1), ("blue sky all day long", p2), ("the answer is forty two", p1)]
    assert "".join(s.text for s in segs) == text


def test_detect_prefers_the_longest_match_and_never_overlaps():
    known = {"alpha beta gamma delta": ("s", "a", 1), "beta gamma": ("s", "b", 1)}
    segs = sg.detect([Segment("x alpha beta gamma delta y beta gamma z")], Known.of(known))
    assert pairs(segs) == [("x ", False), ("alpha beta gamma delta", True), (" y ", False),
                           ("beta gamma", True), (" z", False)]


def test_detect_leaves_explicit_blocks_whole_but_names_their_producer():
    known = {"beta gamma": ("s", "b", 1)}
    segs = sg.detect([Segment("beta gamma", shared=True), Segment("beta gamma!")], Known.of(known))
    assert [(s.text, s.shared, s.producer) for s in segs] == [
        ("beta gamma", True, ("s", "b", 1)), ("beta gamma", True, ("s", "b", 1)), ("!", False, None)]


def test_completion_prompt_text():
    assert pairs(sg.text(f"a{SEP}b{SEP}c", True, Known())) == [("a", False), ("b", True), ("c", False)]
    assert pairs(sg.text(f"a{SEP}b{SEP}c", False, Known())) == [(f"a{SEP}b{SEP}c", False)]


def test_detect_time_does_not_grow_with_outputs_absent_from_the_prompt():
    # Every prompt of a round is searched for the outputs of three rounds: with many agents,
    # trying each output against the whole prompt stalled the event loop (K x N).
    rng = random.Random(3)

    def sentence(k: int) -> str:
        return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
                        for _ in range(k))

    outputs = [sentence(rng.randint(5, 40)) for _ in range(3000)]
    prompt = " ".join(f"{rng.choice(outputs[:20])} {sentence(4)}" for _ in range(2000))  # ~400k chars

    def timed(known: Known) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            segs = sg.detect([Segment(prompt)], known)
            best = min(best, time.perf_counter() - t)
        assert "".join(s.text for s in segs) == prompt
        return best

    few = Known.of({o: ("s", "a", 1) for o in outputs[:20]})
    many = Known.of({o: ("s", "a", 1) for o in outputs})
    assert sg.detect([Segment(prompt)], few) == sg.detect([Segment(prompt)], many)
    assert timed(many) < 10 * timed(few)


def test_detect_ignores_an_empty_output():
    def hang(*_):
        raise TimeoutError("detect did not return")

    old = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        segs = sg.detect([Segment("some prompt text")], Known.of({"": ("s", "a", 1)}))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert pairs(segs) == [("some prompt text", False)]


def test_detect_time_does_not_grow_with_messages_times_outputs():
    # With separators on, every stretch of template text between two shared blocks is its own
    # private segment: searching each of them for every output took 15 s for 10k messages.
    rng = random.Random(4)
    outputs = ["".join(rng.choice("abcdefghij ") for _ in range(20)) for _ in range(1000)]
    messages = [{"role": "user", "content": f"{SEP}block {i}{SEP}"} for i in range(2000)]

    def timed(known: Known) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            sg.chat(render, messages, explicit=True, known=known)
            best = min(best, time.perf_counter() - t)
        return best

    few = timed(Known.of({o: ("s", "a", 1) for o in outputs[:10]}))
    assert timed(Known.of({o: ("s", "a", 1) for o in outputs})) < 10 * few + 0.05


def test_detect_finds_an_output_right_after_an_occurrence_cut_by_a_segment_boundary():
    out = "ab" * 8
    segs = sg.detect([Segment("zz" + "ab" * 5), Segment("ab" * 8 + "zz")], Known.of({out: ("s", "a", 1)}))
    assert pairs(segs) == [("zz" + "ab" * 5, False), (out, True), ("zz", False)]


def test_detect_matches_a_search_of_each_private_segment_on_its_own():
    def reference(segs: list[Segment], known: dict) -> list[tuple[str, bool]]:
        out: list[tuple[str, bool]] = []
        for s in segs:
            if s.shared:
                out.append((s.text, True))
                continue
            found = []
            for k in known:
                i = s.text.find(k)
                while i >= 0:
                    found.append((i, i + len(k)))
                    i = s.text.find(k, i + len(k))
            taken: list[tuple[int, int]] = []
            for a, b in sorted(found, key=lambda m: (m[0] - m[1], m[0])):  # longest, then leftmost
                if all(b <= c or d <= a for c, d in taken):
                    taken.append((a, b))
            pos = 0
            for a, b in sorted(taken):
                out += [(s.text[pos:a], False)] if a > pos else []
                out.append((s.text[a:b], True))
                pos = b
            out += [(s.text[pos:], False)] if pos < len(s.text) else []
        merged: list[tuple[str, bool]] = []
        for t, shared in out:
            if merged and not shared and not merged[-1][1]:
                merged[-1] = (merged[-1][0] + t, False)
            else:
                merged.append((t, shared))
        return merged

    rng = random.Random(5)
    for _ in range(500):
        known = {"".join(rng.choice("ab ") for _ in range(rng.randint(1, 20))): ("s", "a", 1)
                 for _ in range(rng.randint(1, 6))}
        segs = [Segment("".join(rng.choice("ab c") for _ in range(rng.randint(0, 40))), rng.random() < 0.3)
                for _ in range(rng.randint(1, 6))]
        expected = reference(segs, known)
        assert pairs(sg.detect(segs, Known.of(known))) == expected
