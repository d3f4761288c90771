"""Incremental detokenisation and stop-string matching.

Decoding one token on its own does not give the text it adds to a sequence:

- a byte-level token may hold half of a multi-byte UTF-8 character (Chinese, emoji), which
  decodes to U+FFFD until the rest arrives;
- SentencePiece-style decoders strip the leading space of the first token they see, and
  tokenizers may add or drop spaces depending on the neighbouring tokens.

So, as vLLM does, each sequence keeps a small window of recent tokens: ``prefix`` tokens that
were already turned into text, followed by tokens not yet turned into text. The new text is
``decode(window)`` minus ``decode(prefix)``: both see the same left context, so context effects
cancel out. When the window's text ends in U+FFFD the token is held back (it may be the start
of a character) and the window grows until the character is complete. Decoding the whole
sequence each step would give the same text at a cost growing with its length.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from pagellm.core.stop_strings import StopStringMatcher, truncate_at_stop

# Prompt tokens decoded as left context of the first generated token (vLLM uses the same).
INITIAL_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"
MAX_UTF8_BYTES = 4


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, one token at a time.

    Invariants: ``_token_ids`` is the window, ``_token_ids[:_read_offset]`` the prefix whose
    text ``_prefix_text`` was already emitted (or belongs to the prompt); every token after it
    is held back. Concatenating everything ``add_token`` returns, then ``flush()``, gives the
    generated text (for byte-level tokenizers exactly ``decode(generated ids)`` when the prompt
    is empty, and ``decode(prompt + generated)`` minus ``decode(prompt)`` otherwise).
    """

    __slots__ = ("_decode", "_token_ids", "_read_offset", "_prefix_text")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self._decode = _make_decode(tokenizer, skip_special_tokens,
                                    spaces_between_special_tokens)
        self._token_ids, self._prefix_text = _initial_context(prompt_token_ids, self._decode)
        self._read_offset = len(self._token_ids)

    def add_token(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes ("" if held back)."""
        self._token_ids.append(token_id)
        text = self._decode(self._token_ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(text)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """Text still held back, e.g. a sequence that ends inside a multi-byte character (the
        caller's final text then shows U+FFFD, as a full decode would). Call once it finishes."""
        if self._read_offset == len(self._token_ids):
            return ""
        text = self._decode(self._token_ids)
        if len(text) <= len(self._prefix_text):
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        new_text = text[len(self._prefix_text):]
        # The tokens just turned into text become the next prefix; older ones are not needed.
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._token_ids)
        return new_text


def _initial_context(prompt_token_ids: Sequence[int],
                     decode: Callable[[list[int]], str]) -> tuple[list[int], str]:
    """The last few prompt tokens, and their text, as left context for the first output.

    A window that starts inside a multi-byte character decodes to U+FFFD at its start (with a
    byte-fallback decoder, its whole run of byte tokens does), so it is moved back, at most by
    the length of the longest UTF-8 character, until it starts on a character.
    """
    start = max(0, len(prompt_token_ids) - INITIAL_CONTEXT_TOKENS)
    context = list(prompt_token_ids[start:])
    text = decode(context) if context else ""
    earliest = max(0, start - (MAX_UTF8_BYTES - 1))
    while text.startswith(REPLACEMENT_CHAR) and start > earliest:
        start -= 1
        context.insert(0, prompt_token_ids[start])
        text = decode(context)
    return context, text


def _make_decode(tokenizer: Any, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool) -> Callable[[list[int]], str]:
    """A fast ``ids -> text`` function for the tokenizer.

    For a Rust-backed tokenizer it calls the backend directly: transformers' ``decode`` adds
    tens of microseconds of Python per call, twice per token of every running sequence. Its
    ``clean_up_tokenization_spaces`` is deliberately not applied: it rewrites text depending
    on the following characters, which an incremental decoder cannot know yet.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and hasattr(tokenizer, "decode_batch"):
        backend = tokenizer  # a bare tokenizers.Tokenizer
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        clean_up_tokenization_spaces=False)


def check_stop_strings(text: str, new_text_len: int, stop: Sequence[str],
                       include_stop_str_in_output: bool) -> tuple[str, str] | None:
    """Looks for a stop string in ``text`` whose last ``new_text_len`` characters just arrived.

    Only matches that end in the new text are searched for (earlier ones were found when their
    own text arrived), so a match may start up to ``len(stop_str) - 1`` characters before the
    new text. The earliest match wins (the first listed on a tie), so the returned text never
    contains a complete stop string other than the one kept by ``include_stop_str_in_output``.
    The engine keeps a ``StopStringMatcher`` state per sequence instead of rescanning; this
    one-shot form builds the automaton each call.

    Returns ``(text truncated before the stop string, or after it when included, stop_str)``,
    or None when no stop string appears.
    """
    if new_text_len <= 0 or not stop:
        return None
    old_len = len(text) - new_text_len
    start = max(0, old_len - max(map(len, stop)) + 1)
    matcher = StopStringMatcher(stop)
    state, _ = matcher.feed(0, text[start:old_len])
    _, best = matcher.feed(state, text[old_len:])
    if best is None:
        return None
    stop_str = stop[best[1]]
    return truncate_at_stop(text, old_len + best[0], stop_str,
                            include_stop_str_in_output), stop_str
