"""The stop-string automaton: the same matches as a plain scan, fed a token's text at a time,
and a cost per character independent of the number of stop strings."""
from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.stop_strings import StopStringMatcher

ALPHABET = "abc"


def reference(text: str, new_len: int, stops: list[str]) -> tuple[int, int] | None:
    """(start, index) of the earliest match ending in the last ``new_len`` characters."""
    old = len(text) - new_len
    found = [(start, i) for i, s in enumerate(stops)
             for start in range(len(text) - len(s) + 1)
             if text.startswith(s, start) and start + len(s) > old]
    return min(found) if found else None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=6),
       st.lists(st.text(ALPHABET, min_size=1, max_size=3), min_size=1, max_size=12))
def test_streaming_matches_equal_a_full_scan(stops, pieces):
    matcher = StopStringMatcher(stops)
    state, text = 0, ""
    for piece in pieces:
        text += piece
        state, best = matcher.feed(state, piece)
        expected = reference(text, len(piece), stops)
        got = None if best is None else (len(text) - len(piece) + best[0], best[1])
        assert got == expected, (stops, text)
        if expected is not None:
            break


def test_cost_does_not_grow_with_the_number_of_stop_strings():
    text = "the quick brown fox jumps over the lazy dog " * 50

    def seconds(stops: list[str]) -> float:
        matcher = StopStringMatcher(stops)
        state, start = 0, time.perf_counter()
        for char in text:
            state, _ = matcher.feed(state, char)
        return time.perf_counter() - start

    few = min(seconds([f"<stop{i}>" for i in range(2)]) for _ in range(3))
    many = min(seconds([f"<stop{i}>" for i in range(20_000)]) for _ in range(3))
    assert many < few * 5 + 0.01, (few, many)
