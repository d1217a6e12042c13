"""Which token runs of a producer's output are kept as bases (backend/published.py)."""

from __future__ import annotations

from tokendance.backend.published import Run, runs

# "\n", "There", " are", " ", " no"
VOCAB = {"\nThere are ": [10, 20, 30, 40], "There are": [20, 30], "\nThere are no": [10, 20, 30, 50],
         "There are no": [20, 30, 50], " ": [40]}


def test_the_text_and_the_stripped_text_where_they_lie_among_the_generated_tokens():
    # Each also without its first token: in a prompt tokenized whole, text right before
    # the answer can join its first token (backend/prompt.py).
    assert runs([10, 20, 30, 40], "\nThere are ", VOCAB.__getitem__) == [
        Run(0, [10, 20, 30, 40]), Run(1, [20, 30, 40]), Run(1, [20, 30]), Run(2, [30])]
    assert runs([10, 20, 30, 50], "\nThere are no", VOCAB.__getitem__) == [
        Run(0, [10, 20, 30, 50]), Run(1, [20, 30, 50]), Run(2, [30, 50])]


def test_text_that_tokenizes_apart_from_the_generated_tokens_is_left_out():
    # Cut by the stop string "no": the text ends in a lone " ", never generated as such.
    assert runs([10, 20, 30, 50], "\nThere are ", VOCAB.__getitem__) == [Run(1, [20, 30]), Run(2, [30])]
    assert runs([50], " ", VOCAB.__getitem__) == []  # nothing but whitespace
    assert runs([60], "Hi", {"Hi": [60]}.__getitem__) == [Run(0, [60])]  # one token: no run without it
