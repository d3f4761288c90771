"""Structured outputs: what a request may constrain its output to, and the grammar compiler.

``StructuredOutputsParams`` has vLLM's names: exactly one of ``json`` (a JSON schema),
``regex``, ``choice`` (one of a list of strings), ``grammar`` (Lark or GBNF) or
``json_object`` (any JSON object). The engine checks it when the request arrives (a bad schema
or regex is a ValueError naming it, so a 400 at the server) and the worker enforces it while
decoding: before each sample, the tokens the grammar cannot accept get -inf (see
``pagellm.worker.grammar``).

The backend is llguidance (Microsoft's guidance, Rust, MIT): it needs no precomputation per
vocabulary or per schema (a JSON schema becomes a matcher in well under a millisecond, where
xgrammar compiles each schema against the whole vocabulary first), it computes a token mask in
tens of microseconds, and it brings no dependency (xgrammar pulls in its own FFI runtime).
The wheel is pure Rust + Python: this module imports no torch.

``GrammarCompiler`` turns a spec into a pristine matcher once per distinct spec (an LRU cache)
and hands out deep copies, one per sequence.
"""
from __future__ import annotations

import json as jsonlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Distinct specs whose compiled matcher is kept. A spec is at most a request body, so the
# cache is bounded in bytes by what the server accepts.
GRAMMAR_CACHE_SIZE = 256
# Longest grammar text accepted (a schema, a regex or a grammar). Compiling is linear in it.
MAX_GRAMMAR_CHARS = 1 << 20
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# How a model's reasoning precedes its answer (the server's --reasoning-parser): "think", the
# answer may open with <think>...</think> (Qwen3, QwQ); "deepseek_r1", the chat template
# opened <think>, so the answer is reasoning up to the first </think> (DeepSeek-R1).
REASONING_PARSERS = ("think", "deepseek_r1")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint. ``disable_any_whitespace`` (vLLM's flag) makes JSON compact:
    ``,`` and ``:`` separators and no whitespace. It defaults to True here, unlike
    vLLM: a model free to add whitespace anywhere may add it forever (small and random models
    do), and OpenAI's own structured outputs are compact too; pass False for vLLM's behaviour.

    ``reasoning`` (one of REASONING_PARSERS, or None) puts the constraint on the answer that
    follows the model's reasoning in that parser's format, the reasoning itself being free
    text; the chat server sets it from --reasoning-parser, as vLLM applies structured outputs
    only once the reasoning has ended.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    reasoning: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}, "
                             f"got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its "
                             f"text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(f"structured_outputs.reasoning must be one of "
                             f"{', '.join(REASONING_PARSERS)} or None, got {self.reasoning!r}")
        _, text = self.source()
        if len(text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} has {len(text)} characters, more "
                             f"than the limit of {MAX_GRAMMAR_CHARS} (MAX_GRAMMAR_CHARS)")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def source(self) -> tuple[str, str]:
        """(kind, text): the canonical form, also the compiler's cache key."""
        kind = self.kind
        if kind == "json":
            # key order kept: it is the order in which properties are generated
            text = self.json if isinstance(self.json, str) else jsonlib.dumps(self.json)
        elif kind == "choice":
            text = jsonlib.dumps(self.choice)
        elif kind == "json_object":
            text = '{"type": "object"}'
        else:
            text = getattr(self, kind)
        return kind, text

    def cache_key(self) -> tuple[str, str, bool, str | None]:
        return (*self.source(), self.disable_any_whitespace, self.reasoning)


def reasoning_rules(parser: str | None, unfinished: bool = False) -> list[str]:
    """Lark rules of ``start``: the reasoning that ``parser`` writes (free text, which nothing
    but ``</think>`` ends), then the rule ``answer``; ``answer`` alone without a parser.
    Whitespace may separate the two, as models write it after ``</think>``. With
    ``unfinished``, the text may also end within the reasoning."""
    if parser is None:
        return ["start: answer"]
    if parser == "think":  # optional, leading
        start, opener = "answer | think THINK_SPACE? answer", r"[ \t\r\n]*<think>"
    elif parser == "deepseek_r1":  # the template opened <think>
        start, opener = "think THINK_SPACE? answer", ""
    else:
        raise ValueError(f"reasoning parser {parser!r} is unknown; choices: "
                         f"{', '.join(REASONING_PARSERS)}")
    rules = [f"start: {start}" + (" | REASONING" if unfinished else ""),
             rf"think[lazy]: /{opener}(.|\n)*<\/think>/", r"THINK_SPACE: /[ \t\r\n]+/"]
    if unfinished:
        rules.append(rf"REASONING: /{opener}(.|\n)*/ & ~/(.|\n)*<\/think>(.|\n)*/")
    return rules


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (not yet checked against a tokenizer)."""
    kind, text = params.source()
    inner = _constraint_grammar(kind, text, params.disable_any_whitespace)
    if params.reasoning is None:
        return inner
    try:  # a TopLevelGrammar (json, regex), or a Lark text (choice, grammar)
        grammars = jsonlib.loads(inner)["grammars"]
    except (ValueError, TypeError, KeyError):
        grammars = [{"lark_grammar": inner}]
    grammars[0] = {**grammars[0], "name": "answer"}
    start = "\n".join(reasoning_rules(params.reasoning) + ["answer: @answer"]) + "\n"
    return jsonlib.dumps({"grammars": [{"name": "start", "lark_grammar": start}, *grammars]})


def _constraint_grammar(kind: str, text: str, disable_any_whitespace: bool) -> str:
    import llguidance

    if kind in ("json", "json_object"):
        try:
            schema = jsonlib.loads(text)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got "
                             f"{type(schema).__name__}")
        options = {"whitespace_flexible": not disable_any_whitespace}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)


class GrammarCompiler:
    """Compiles specs into llguidance matchers for one tokenizer and vocabulary.

    Invariants: ``_cache`` holds at most ``GRAMMAR_CACHE_SIZE`` pristine matchers (never
    advanced: callers get deep copies); the llguidance tokenizer is built once, on first use
    (about a second for a 50k vocabulary). Thread-safe: the engine compiles when a request
    arrives, the worker copies when a sequence first samples.
    """

    def __init__(self, tokenizer: Any, vocab_size: int,
                 eos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # distinct compilations (cache misses), for tests and stats

    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_id)
            except Exception as exc:  # noqa: BLE001 - slow (Python) tokenizers, exotic vocabs
                raise ValueError(f"structured outputs need a fast (Rust) Hugging Face "
                                 f"tokenizer: {exc}") from exc
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams):
        """The pristine matcher of ``params``; ValueError naming the field when invalid."""
        import llguidance

        key = params.cache_key()
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                return matcher
            tokenizer = self.ll_tokenizer()
            grammar = grammar_text(params)
            error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{params.kind} is invalid: "
                                 f"{error.strip()}")
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"structured_outputs.{params.kind} is invalid: "
                                 f"{matcher.get_error().strip()}")
            self.num_compiled += 1
            self._cache[key] = matcher
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
            return matcher

    def new_matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one sequence (a copy of the cached one)."""
        pristine = self.compile(params)
        with self._lock:
            return pristine.deep_copy()
