"""Sessions' memory of outputs: what a later prompt is searched for."""

import random
import time

from tokendance.backend.api import Segment
from tokendance.proxy import segment as sg
from tokendance.proxy.known import ENTRY_BYTES
from tokendance.proxy.session import Meta, Sessions


def shared(segs: list[Segment]) -> list[str]:
    return [s.text for s in segs if s.shared]


def test_an_output_with_whitespace_around_it_is_found_as_generated_and_stripped():
    # Completions often begin with a space (" The answer ..."): echoed verbatim, the span must
    # hold those exact characters, so its tokens are the ones the producer generated
    # ("ĠThe", not "Ġ" + "The"), and the producer's KV of them can be its base.
    sessions = Sessions()
    rnd = sessions.round("s", 1)
    out = " The answer is forty-two, said Deep Thought.\n"
    sessions.remember(rnd, "a", out)
    known = sessions.known("s", 2)
    verbatim = sg.detect([Segment(f"Q: what is it?\nA:{out}Q: and then?")], known)
    assert shared(verbatim) == [out]
    framed = sg.detect([Segment(f"bob said '{out.strip()}'")], known)  # a framework that strips
    assert shared(framed) == [out.strip()]
    assert {known.get(out), known.get(out.strip())} == {("s", "a", 1)}


def test_outputs_shorter_than_min_chars_or_blank_are_not_remembered():
    sessions = Sessions(min_chars=16)
    rnd = sessions.round("s", 1)
    for text in ("", "   \n", "short answer", "  fifteen chars  "):
        sessions.remember(rnd, "a", text)
    assert len(rnd.outputs) == 0


def test_a_round_remembers_a_bounded_amount_of_output():
    # Requests naming one round are not limited in number: its memory must be.
    sessions = Sessions(max_round_bytes=20 * (ENTRY_BYTES + 26))
    rnd = sessions.round("s", 1)
    for i in range(200):
        sessions.remember(rnd, f"a{i}", f"answer number {i:04d} of many")
    assert len(rnd.outputs[""]) == 20
    assert "answer number 0000 of many" in sessions.known("s", 2)
    assert "answer number 0199 of many" not in sessions.known("s", 2)


def test_all_sessions_remember_a_bounded_amount_the_least_recent_rounds_forgotten_first():
    # 10k sessions x 64 rounds each were bounded only per round; an output costs ~1.5 KB of index.
    sessions = Sessions(max_bytes=50 * (ENTRY_BYTES + 30))
    for k in range(10):
        rnd = sessions.round(f"s{k}", 1)
        for i in range(10):
            sessions.remember(rnd, "a", f"session {k} output number {i:04d}")
    assert sessions.bytes <= 50 * (ENTRY_BYTES + 30)
    assert "session 0 output number 0000" not in sessions.known("s0", 1)
    assert "session 9 output number 0009" in sessions.known("s9", 1)
    assert sessions.bytes == sum(o.size for s in sessions.all.values() for r in s.rounds.values()
                                 for o in r.outputs.values())


def test_rounds_and_sessions_dropped_give_their_memory_back():
    sessions = Sessions(keep=2, max_sessions=1)
    for k in (1, 2, 3):
        sessions.remember(sessions.round("s", k), "a", f"round {k} said this long thing")
    assert sessions.find("s", 1) is None
    assert sessions.bytes == 2 * (ENTRY_BYTES + len("round 1 said this long thing"))
    sessions.round("t", 1)  # over max_sessions: "s" is idle, so it goes
    assert "s" not in sessions.all and sessions.bytes == 0


def test_searching_a_prompt_costs_about_the_same_for_50_or_50000_remembered_outputs():
    # 1000 agents over three rounds, or one client flooding a round: every prompt of the
    # session is searched, on the event loop that serves every session.
    rng = random.Random(6)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(3000)]

    def sentence() -> str:
        return " ".join(rng.choice(words) for _ in range(8))

    many, few = Sessions(), Sessions()
    outputs = [sentence() for _ in range(50_000)]
    for i, out in enumerate(outputs):
        many.remember(many.round("s", 1), f"a{i}", out)
        if i < 50:
            few.remember(few.round("s", 1), f"a{i}", out)
    prompt = "\n".join(f"{rng.choice(outputs[:50])} {sentence()}" for _ in range(300))

    def timed(sessions: Sessions) -> tuple[float, list[Segment]]:
        best, segs = float("inf"), []
        for _ in range(3):
            t = time.perf_counter()
            segs = sg.detect([Segment(prompt)], sessions.known("s", 2))
            best = min(best, time.perf_counter() - t)
        return best, segs

    (t_many, segs_many), (t_few, segs_few) = timed(many), timed(few)
    assert [(s.text, s.shared) for s in segs_many] == [(s.text, s.shared) for s in segs_few]
    assert t_many < 5 * t_few + 0.01


def test_a_round_older_than_the_kept_ones_lives_while_it_is_used():
    # A straggler (an agent that speaks less often, whose inferred round lags) opened a round
    # below the `keep` newest: it was trimmed as it was made, so its requests never shared a
    # gate, its stats could not be read and its outputs were never looked for.
    sessions = Sessions(keep=3)
    for k in (5, 6, 7):
        sessions.round("s", k)
    late = sessions.round("s", 1)
    assert sessions.find("s", 1) is late
    assert sessions.round("s", 1) is late
    sessions.remember(late, "slow", "a late but useful answer")
    assert "a late but useful answer" in sessions.known("s", 2)


def test_a_prompt_far_ahead_of_the_other_agents_still_finds_their_outputs():
    """A group chat's manager speaks every turn: by its fifth request it is in round 5 while
    the speakers it quotes answered in their rounds 1 and 2. Searching only rounds 3-5 lost
    all of that reuse."""
    sessions = Sessions()
    said = {"alice": "Alice thinks the bridge should be rebuilt in stone.",
            "bob": "Bob would rather have a ferry across the river instead."}
    for n in range(1, 5):  # the manager's turns, between the speakers'
        sessions.commit(Meta(session="g", agent="manager"), n)
    for agent, n in (("alice", 1), ("bob", 1), ("alice", 2)):
        rnd, _ = sessions.commit(Meta(session="g", agent=agent), n)
        sessions.remember(rnd, agent, said[agent] if n == 1 else said[agent] + " Again.")
    number = sessions.infer(Meta(session="g", agent="manager"))
    assert number == 5
    prompt = "Conversation so far:\n" + "\n".join(f"{a}: {t}" for a, t in said.items())
    segs = sg.detect([Segment(prompt)], sessions.known("g", number))
    assert sorted(shared(segs)) == sorted(said.values())


def test_synchronous_rounds_search_the_same_rounds_as_before():
    sessions = Sessions()
    for n in range(1, 8):
        for agent in ("a", "b", "c"):
            rnd, _ = sessions.commit(Meta(session="s", agent=agent), n)
            sessions.remember(rnd, agent, f"round {n} answer of agent {agent}, long enough")
    found = {p[2] for o in sessions.known("s", 7).rounds for p in o.producers.values()}
    assert found == {5, 6, 7}


def test_agents_spread_over_many_rounds_bound_the_rounds_searched():
    sessions = Sessions()
    for n in range(1, 31):  # agent k answered in round k only: thirty rounds with outputs
        rnd, _ = sessions.commit(Meta(session="w", agent=f"k{n}"), n)
        sessions.remember(rnd, f"k{n}", f"the answer agent k{n} gave in its round, long enough")
    searched = sessions.known("w", 31).rounds
    assert len(searched) == sessions.reach - 1  # round 31 has no outputs yet
    assert {p[2] for o in searched for p in o.producers.values()} == set(range(20, 31))
