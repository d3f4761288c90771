"""Sampling parameters, with vLLM's names and defaults.

A user builds one ``SamplingParams`` per request (or one for a whole batch). Every value is
checked when the object is created, so a bad value fails in the caller's code with a message
that names the field, the value and the limit, instead of surfacing later as a NaN or an index
error inside a batched engine step that also serves other requests.
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

from pagellm.structured_outputs import StructuredOutputsParams

# Above this temperature a row is sampled; at or below it, it is decoded greedily. A tiny
# positive temperature would otherwise divide the logits into overflow.
SAMPLING_EPS = 1e-5

# The most top-k logprobs a request may ask for per token. Each one costs a top-k over the
# vocabulary and a Python object per token, so an unbounded value is a cheap denial of service.
MAX_LOGPROBS = 20

# The sampler computes in float32. A value that float32 turns into 0 or inf (1e-46, 1e300) would
# give NaN or inf logits, so every float field is bounded: nonzero magnitudes below float32's
# smallest normal number are refused, and the unbounded fields get ceilings far beyond any use.
# vLLM's own ranges apply where it has them (top_p, min_p, the penalties, temperature >= 0).
FLOAT32_TINY = 1.1754943508222875e-38
MAX_TEMPERATURE = 1e3  # the distribution is uniform to float32 precision long before this
MIN_REPETITION_PENALTY = 1e-3
MAX_REPETITION_PENALTY = 1e3
# Stop strings are matched on every new token of the sequence: bounded so that one request
# cannot slow the engine loop for every other one (OpenAI allows 4).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Each stop token id costs a ban per step while min_tokens is not reached.
MAX_STOP_TOKEN_IDS = 1024
# allowed_token_ids builds a [vocab] mask per step; bad_words are matched per step.
MAX_ALLOWED_TOKEN_IDS = 1 << 20
MAX_BAD_WORDS = 128
# OpenAI's limits on logit_bias: values in [-100, 100]; at most 300 tokens (we allow more)
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_TOKENS = 1024


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names)."""

    CUMULATIVE = 0  # everything generated so far (the offline API's default)
    DELTA = 1  # only what is new since the request's previous output (streaming)
    FINAL_ONLY = 2  # a single output, when the request finishes


class SamplingType(enum.Enum):
    """How the sampler picks a row's token."""

    GREEDY = "greedy"
    RANDOM = "random"  # shares the engine's global random generator
    RANDOM_SEED = "random_seed"  # has its own generator, seeded from ``seed``


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completions of one request.

    Invariants after construction: every value lies within its documented range; ``stop`` and
    ``stop_token_ids`` are lists (possibly empty); ``top_k`` is 0 when disabled (-1 is accepted
    as vLLM's older spelling and stored as 0); ``max_tokens`` is None only when the engine is to
    fill it in from the model's context length.

    The object remembers which fields its creator passed (``user_set_fields``), so that the
    model's recommended values (generation_config.json) fill in only the others
    (``with_defaults``), as vLLM's ``generation_config="auto"`` does.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    # bad_words as token id sequences, filled in by the engine from its tokenizer
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False,
                                                        compare=False)
    user_set_fields: frozenset[str] = field(default=frozenset(), init=False, repr=False,
                                            compare=False)

    def __post_init__(self) -> None:
        self._check_types()
        self._normalise()
        self._check_ranges()

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streaming caller must hold back so that it never shows the beginning of
        a stop string that later turns out to be complete (and is then cut from the text)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def with_defaults(self, defaults: dict[str, Any]) -> SamplingParams:
        """A validated copy in which every field of ``defaults`` that the creator did not set
        takes the default's value (e.g. the model's recommended temperature); ``self`` when
        there is nothing to fill in."""
        missing = {k: v for k, v in defaults.items() if k not in self.user_set_fields}
        if not missing:
            return self
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        updated = SamplingParams(**{**values, **missing})
        updated.user_set_fields = self.user_set_fields
        updated.bad_words_token_ids = self.bad_words_token_ids
        return updated

    def clone(self) -> SamplingParams:
        """A deep copy: the engine may adjust a request's copy (e.g. resolve ``max_tokens``)
        without touching the object the user passed, which may be shared by many requests."""
        return copy.deepcopy(self)

    def _check_types(self) -> None:
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got "
                             f"{self.output_kind!r}")
        for name in ("n", "top_k", "min_tokens"):
            _require_int(name, getattr(self, name))
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
        for name in _FLOAT_FIELDS:
            _require_real(name, getattr(self, name))
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_stop_types(self.stop, self.stop_token_ids)
        _check_restriction_types(self.structured_outputs, self.allowed_token_ids,
                                 self.bad_words)
        _check_logit_bias(self.logit_bias)

    def _normalise(self) -> None:
        # numpy scalars pass the type checks; store plain Python numbers.
        for name in ("n", "top_k", "min_tokens", "max_tokens", "seed", "logprobs",
                     "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, int(value))
        for name in _FLOAT_FIELDS:
            setattr(self, name, float(getattr(self, name)))
        if self.top_k == -1:
            self.top_k = 0
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or ()]
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted({int(t) for t in self.allowed_token_ids})
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}

    def _check_ranges(self) -> None:
        _require("n", self.n, self.n >= 1, "must be at least 1")
        if self.seed is not None:
            _require("seed", self.seed, -(2**63) <= self.seed < 2**64,
                     "must be in [-2**63, 2**64)")
        _require("temperature", self.temperature, self.temperature >= 0.0, "must be >= 0")
        _require("top_p", self.top_p, 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        _require("top_k", self.top_k, self.top_k >= 0,
                 "must be -1 or 0 (disabled) or at least 1")
        _require("min_p", self.min_p, 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        _require("temperature", self.temperature, self.temperature <= MAX_TEMPERATURE,
                 f"must be <= {MAX_TEMPERATURE:g} (MAX_TEMPERATURE)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(name, value, -2.0 <= value <= 2.0, "must be in [-2, 2]")
        _require("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0.0,
                 "must be > 0")
        _require("repetition_penalty", self.repetition_penalty,
                 MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                 f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _require(name, value, value == 0.0 or abs(value) >= FLOAT32_TINY,
                     f"must be 0 or at least {FLOAT32_TINY:.4g} in magnitude (float32 would "
                     "round it to 0)")
        if self.max_tokens is not None:
            _require("max_tokens", self.max_tokens, self.max_tokens >= 1, "must be at least 1")
        _require("min_tokens", self.min_tokens, self.min_tokens >= 0, "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require(name, value, 0 <= value <= MAX_LOGPROBS,
                         f"must be in [0, {MAX_LOGPROBS}] (MAX_LOGPROBS)")
        _check_stop_sizes(self.stop, self.stop_token_ids)
        for t in self.stop_token_ids:
            _require("stop_token_ids", t, t >= 0, "must contain non-negative token ids")
        if self.allowed_token_ids is not None:
            _require("allowed_token_ids", self.allowed_token_ids, bool(self.allowed_token_ids),
                     "must not be empty")
            _require("allowed_token_ids", f"a list of {len(self.allowed_token_ids)} ids",
                     len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                     f"must hold at most {MAX_ALLOWED_TOKEN_IDS} ids (MAX_ALLOWED_TOKEN_IDS)")
            _require("allowed_token_ids", self.allowed_token_ids[0],
                     self.allowed_token_ids[0] >= 0, "must contain non-negative token ids")
        if self.bad_words is not None:
            _require("bad_words", f"a list of {len(self.bad_words)} words",
                     len(self.bad_words) <= MAX_BAD_WORDS,
                     f"must hold at most {MAX_BAD_WORDS} words (MAX_BAD_WORDS)")
            for word in self.bad_words:
                _require("bad_words", word, 0 < len(word) <= MAX_STOP_STRING_CHARS,
                         f"must hold words of 1 to {MAX_STOP_STRING_CHARS} characters")


_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                 "top_p", "min_p")


def _record_user_set_fields(init):
    """Wrap the dataclass ``__init__`` so that an object knows which fields were passed."""
    names = [f.name for f in dataclasses.fields(SamplingParams) if f.init]

    @functools.wraps(init)
    def __init__(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.user_set_fields = frozenset(names[:len(args)]) | frozenset(kwargs)

    return __init__


SamplingParams.__init__ = _record_user_set_fields(SamplingParams.__init__)


def _require(name: str, value: Any, ok: bool, limit: str) -> None:
    if not ok:
        raise ValueError(f"{name} {limit}, got {value!r}")


def _require_int(name: str, value: Any) -> None:
    # bool is an int subclass; True as a count is almost certainly a mistake.
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


def _require_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")


def _check_stop_types(stop: Any, stop_token_ids: Any) -> None:
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be a str or a list of str, got {stop!r}")
    if stop_token_ids is not None:
        if not isinstance(stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of int, got {stop_token_ids!r}")
        for t in stop_token_ids:
            _require_int("stop_token_ids", t)


def _check_restriction_types(structured: Any, allowed: Any, bad_words: Any) -> None:
    if structured is not None and not isinstance(structured, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                         f"{structured!r}")
    if allowed is not None:
        if not isinstance(allowed, (list, tuple)):
            raise ValueError(f"allowed_token_ids must be a list of int, got {allowed!r}")
        for t in allowed:
            _require_int("allowed_token_ids", t)
    if bad_words is not None:
        if not isinstance(bad_words, (list, tuple)) or not all(isinstance(w, str)
                                                               for w in bad_words):
            raise ValueError(f"bad_words must be a list of str, got {bad_words!r}")


def _check_logit_bias(logit_bias: Any) -> None:
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {logit_bias!r}")
    _require("logit_bias", f"a dict of {len(logit_bias)} tokens",
             len(logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
             f"must hold at most {MAX_LOGIT_BIAS_TOKENS} tokens (MAX_LOGIT_BIAS_TOKENS)")
    for token, bias in logit_bias.items():
        _require_int("logit_bias", token)
        _require("logit_bias", token, token >= 0, "must have non-negative token ids")
        _require_real("logit_bias", bias)
        _require("logit_bias", bias, -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                 f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")


def _check_stop_sizes(stop: list[str], stop_token_ids: list[int]) -> None:
    _require("stop", f"a list of {len(stop)} strings", len(stop) <= MAX_STOP_STRINGS,
             f"must hold at most {MAX_STOP_STRINGS} strings (MAX_STOP_STRINGS)")
    for s in stop:
        _require("stop", s, len(s) > 0, "must not contain empty strings")
        _require("stop", f"a string of {len(s)} characters", len(s) <= MAX_STOP_STRING_CHARS,
                 f"strings must be at most {MAX_STOP_STRING_CHARS} characters "
                 "(MAX_STOP_STRING_CHARS)")
    _require("stop_token_ids", f"a list of {len(stop_token_ids)} ids",
             len(stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"must hold at most {MAX_STOP_TOKEN_IDS} ids (MAX_STOP_TOKEN_IDS)")
