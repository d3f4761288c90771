"""Tokenisation for the HTTP handlers, off the event loop.

Encoding a prompt of megabytes takes seconds; on the event loop it would stall every open
stream and /health for that long. So the server's tokenizer work (prompts, chat templates,
token-id prompts decoded for ``echo``, /tokenize, /detokenize) runs on one worker thread that
owns its own copy of the tokenizer (a Rust tokenizer must not be shared across threads; the
engine loop thread and the event loop keep theirs). One thread is enough: Rust tokenizers
release the GIL while they encode, and a queue of one keeps a flood of large prompts from
taking every core from the engine.

Before any of that, cheap checks on the event loop refuse what could never be served: text
that is not valid Unicode (a lone UTF-16 surrogate, which JSON allows and the tokenizer
rejects with a TypeError), and a prompt with more characters than ``max_model_len`` tokens
could hold (every token covers at most ``max_token_chars`` characters, the longest vocabulary
entry), so a prompt of megabytes is refused in microseconds instead of tokenised first.
"""
from __future__ import annotations

import asyncio
import copy
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagellm.entrypoints.openai.errors import APIError

logger = logging.getLogger("pagellm")


class TokenizerWorker:
    """Runs tokenizer calls on one dedicated thread with its own tokenizer copy.

    Invariant: ``_tokenizer`` is touched by the worker thread only.
    """

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self._tokenizer = own_copy(tokenizer)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-tokenize")
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        self.max_token_chars = longest_token_chars(tokenizer)
        self.max_prompt_chars = self.max_model_len * self.max_token_chars

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self, fn, *args):
        """Run other slow text work (compiling a grammar) on this thread."""
        return await self._run(fn, *args)

    def check_text(self, text: str, param: str, length_limited: bool = True) -> None:
        """400 for text that is not valid Unicode or could never fit the context."""
        if length_limited and len(text) > self.max_prompt_chars:
            raise APIError(
                f"{param} has {len(text)} characters: more than max_model_len="
                f"{self.max_model_len} tokens of at most {self.max_token_chars} characters "
                f"each can hold ({self.max_prompt_chars})", 400, param)
        check_unicode(text, param)

    async def encode(self, text: str, param: str = "prompt",
                     add_special_tokens: bool | None = None) -> list[int]:
        # The same call as LLMEngine.tokenize_prompt (no add_special_tokens argument) unless
        # the caller chose, so a prompt tokenises identically here and offline.
        self.check_text(text, param)
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return await self._run(lambda: list(self._tokenizer.encode(text, **kwargs)))

    def check_token_ids(self, ids: list[int], param: str, limit: int | None = None) -> None:
        limit = self.max_model_len if limit is None else limit
        if len(ids) > limit:
            raise APIError(f"{param} holds {len(ids)} token ids, more than the limit of {limit} "
                           f"(max_model_len)", 400, param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(f"{param} token id {bad} is out of range [0, {self.vocab_size})", 400,
                           param)

    async def decode(self, ids: list[int], param: str = "tokens") -> str:
        self.check_token_ids(ids, param)
        return await self._run(lambda: self._tokenizer.decode(ids))

    def has_chat_template(self) -> bool:
        return getattr(self._tokenizer, "chat_template", None) is not None

    def template_source(self) -> str:
        template = getattr(self._tokenizer, "chat_template", None)
        return template if isinstance(template, str) else json.dumps(template)

    async def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool,
                                  **options: Any) -> list[int]:
        """``options``: apply_chat_template's ``tools``, ``chat_template``,
        ``continue_final_message`` and the template's own variables."""
        for i, message in enumerate(conversation):
            if message.get("content") is not None:
                self.check_text(message["content"], f"messages.{i}.content")
        options = {k: v for k, v in options.items() if v is not None}

        def apply() -> list[int]:
            ids = self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                **options)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)

        return await self._run(apply)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def check_unicode(text: str, param: str) -> None:
    """JSON's ``\\ud800`` escapes give Python strings that no UTF-8 encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(f"{param} is not valid Unicode: a lone UTF-16 surrogate "
                       f"{text[exc.start]!r} at index {exc.start}", 400, param) from None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its vocabulary entry's length (a
    byte-level entry spells each byte as one character, so it is never shorter than the text
    it covers). At least 1; 64 when the tokenizer does not expose its vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
        return max(1, max(len(token) for token in vocab))
    except Exception:  # noqa: BLE001 - exotic tokenizers: a generous fixed bound
        return 64


def own_copy(tokenizer: Any) -> Any:
    """A copy for one thread; the original stays with its owner."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - an exotic tokenizer that cannot be copied
        logger.warning("could not copy the tokenizer; sharing it across threads")
        return tokenizer
