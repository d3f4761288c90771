"""Stop strings matched with an Aho-Corasick automaton, fed only the text each token adds.

Scanning every stop string over the recent text for every new token costs (number of stop
strings) x (their length) per token, inside the engine loop that serves every request: one
request with many stop strings slowed everyone's stream. The automaton reads each new
character once, whatever the number of stop strings, and a sequence keeps its state between
tokens, so a stop string spread over several tokens is still found.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class StopStringMatcher:
    """The Aho-Corasick automaton of one request's stop strings.

    Invariants: state 0 is the root; ``_goto[s]`` maps a character to the next state;
    ``_fail[s]`` is the state of the longest proper suffix of ``s``'s string that is a prefix
    of some stop string; ``_out[s]`` lists (by index in ``stops``) every stop string that is a
    suffix of ``s``'s string. Immutable once built: any number of sequences may share it.
    """

    __slots__ = ("stops", "_goto", "_fail", "_out")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self._goto: list[dict[str, int]] = [{}]
        self._out: list[tuple[int, ...]] = [()]
        for index, stop in enumerate(self.stops):
            state = 0
            for char in stop:
                nxt = self._goto[state].get(char)
                if nxt is None:
                    nxt = self._goto[state][char] = len(self._goto)
                    self._goto.append({})
                    self._out.append(())
                state = nxt
            self._out[state] += (index,)
        self._fail = [0] * len(self._goto)
        self._link_failures()

    def _link_failures(self) -> None:
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for char, nxt in self._goto[state].items():
                fallback = self._fail[state]
                while fallback and char not in self._goto[fallback]:
                    fallback = self._fail[fallback]
                self._fail[nxt] = self._goto[fallback].get(char, 0)  # depth < nxt's
                self._out[nxt] += self._out[self._fail[nxt]]
                queue.append(nxt)

    def feed(self, state: int, new_text: str) -> tuple[int, tuple[int, int] | None]:
        """Advance ``state`` over ``new_text``. Returns the new state and, among the stop
        strings that end inside ``new_text``, the one starting earliest (the first listed on a
        tie) as ``(start relative to new_text, possibly negative; its index)``, or None."""
        goto, fail, out = self._goto, self._fail, self._out
        best: tuple[int, int] | None = None
        for position, char in enumerate(new_text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            for index in out[state]:
                start = position - len(self.stops[index]) + 1
                if best is None or (start, index) < best:
                    best = (start, index)
        return state, best


def truncate_at_stop(text: str, start: int, stop: str, include: bool) -> str:
    """``text`` cut before the stop string found at ``start``, or after it when included."""
    return text[:start + len(stop)] if include else text[:start]
