"""Tool calls: the grammar that forces one, the parsers that find them in a model's text, and
their streaming as OpenAI's ``delta.tool_calls`` pieces.

Parsers (``--tool-call-parser``), for ``tool_choice="auto"``:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, after
  optional content (Hermes, Qwen 2.5/3 and most ChatML models).
- ``llama3_json``: the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several separated by ``;``), as Llama 3.1+ answers.

``tool_choice="required"`` and a named function are enforced by a JSON-schema grammar
(structured outputs), so the text always parses: ``required`` generates a JSON array of
``{"name", "arguments"}`` objects (one item unless ``parallel_tool_calls``), a named function
generates its arguments object alone. Under ``"auto"``, a function with ``strict: true`` puts
the whole answer under a grammar (``strict_call_grammar``): text stays free, calls always parse.

Streaming: a call's first piece carries its id and name, once the name is complete; then the
arguments text follows as the model writes it, exactly as the text holds it (so the pieces add
up to the final ``arguments``).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagellm.entrypoints.openai.protocol import (DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                                 Tool, ToolCall)
from pagellm.structured_outputs import StructuredOutputsParams, reasoning_rules

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# `{"name": "...", "arguments": ` (or "parameters", llama3's key): where a call's arguments start
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                        r'\s*:\s*')
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_call_grammar(tools: list[Tool], named: str | None,
                        parallel: bool) -> StructuredOutputsParams:
    """The JSON schema a forced tool call is generated under (see the module docstring)."""
    by_name = {t.function.name: t.function for t in tools}
    if named is not None:
        return StructuredOutputsParams(json=_parameters(by_name[named].parameters))
    items = {"anyOf": [{"type": "object",
                        "properties": {"name": {"const": name},
                                       "arguments": _parameters(fn.parameters)},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for name, fn in by_name.items()]}
    schema = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def strict_call_grammar(tools: list[Tool], parser: str, parallel: bool,
                        reasoning: str | None = None) -> StructuredOutputsParams | None:
    """For ``tool_choice="auto"``: None unless a function sets ``strict: true``, else the grammar
    the answer is generated under: free text or tool calls in ``parser``'s format, never a call
    that does not parse. Every call names one of ``tools``; a strict function's arguments are
    valid by its ``parameters`` schema, the others' are any JSON object. One call at most unless
    ``parallel``. With a ``reasoning`` parser the reasoning (``split_reasoning``'s) is free text
    in which a call tag is only text."""
    if not any(t.function.strict for t in tools):
        return None
    key = "arguments" if parser == "hermes" else "parameters"
    calls = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             key: _parameters(t.function.parameters) if t.function.strict
                             else {"type": "object"}},
              "required": ["name", key], "additionalProperties": False} for t in tools]
    # spaced as the Hermes prompt and the templates' tojson write a call
    call = json.dumps({"anyOf": calls, "x-guidance": {
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}})
    # FIRST: the text an answer may start with (not a call; after the reasoning, if any)
    not_first = {"hermes": [], "llama3_json": [r"\{", r"<\|python_tag\|>"]}[parser]
    if reasoning == "think":  # an answer starting with <think> is reasoning
        not_first.append("<think>")
    first = r"/(.|\n)*/" + (rf" & ~/[ \t\r\n]*({'|'.join(not_first)})(.|\n)*/"
                            if not_first else "")
    rules = [f"call_json: %json {call}", f"FIRST: {first}", r"TEXT: /(.|\n)*/"]
    if parser == "hermes":
        # a lazy opener ends at the first <tool_call>: a tag in the text always opens a call
        rules += ["answer: FIRST | first_call call* TEXT" if parallel
                  else "answer: FIRST | first_call",
                  rf'first_call: first_open "\n"? call_json "\n"? "{_HERMES_CLOSE}"',
                  rf'call: call_open "\n"? call_json "\n"? "{_HERMES_CLOSE}"',
                  f'first_open[lazy]: FIRST "{_HERMES_OPEN}"',
                  f'call_open[lazy]: TEXT "{_HERMES_OPEN}"']
    else:  # llama3_json: text that does not start like a call, or the answer is calls
        rules += ['answer: FIRST | WS? call_json (";" WS? call_json)*' if parallel
                  else "answer: FIRST | WS? call_json", r"WS: /[ \t\r\n]+/"]
    # the reasoning runs to the first </think>, or to the end (split_reasoning's rule)
    rules += reasoning_rules(reasoning, unfinished=True)
    return StructuredOutputsParams(grammar="\n".join(["%llguidance {}", *rules]) + "\n")


def _parameters(schema: dict | None) -> dict:
    return schema if schema else {"type": "object", "properties": {},
                                  "additionalProperties": False}


@dataclass(slots=True)
class RawCall:
    name: str
    arguments_start: int
    arguments_end: int | None  # None while the arguments JSON is incomplete


def scan_calls(text: str) -> list[RawCall]:
    """Every ``{"name": ..., "arguments": ...`` in ``text``, with where its arguments are."""
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while (m := _CALL_HEAD.search(text, pos)) is not None:
        start = m.end()
        try:
            _, end = decoder.raw_decode(text, start)
        except ValueError:
            calls.append(RawCall(json.loads(f'"{m.group(1)}"'), start, None))
            break
        calls.append(RawCall(json.loads(f'"{m.group(1)}"'), start, end))
        pos = end
    return calls


def extract_calls(text: str, mode: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished text. ``mode``: a parser name, ``required`` or
    ``named:<function>``. A text whose calls do not parse is all content, no calls."""
    if mode.startswith("named:"):
        return None, [ToolCall(id=new_call_id(),
                               function=FunctionCall(name=mode[6:], arguments=text.strip()))]
    start = calls_start(text, mode)
    if start is None:
        return text, []
    region = text[start:]
    calls = scan_calls(region)
    if not calls or any(c.arguments_end is None for c in calls):
        return text, []
    content = text[:start].strip() if mode == "hermes" else ""
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(
        name=c.name, arguments=region[c.arguments_start:c.arguments_end])) for c in calls]
    return content or None, tool_calls


def calls_start(text: str, mode: str) -> int | None:
    """Where the tool-call part of ``text`` starts, or None when it has none (yet)."""
    if mode == "required":
        return 0
    if mode == "hermes":
        i = text.find(_HERMES_OPEN)
        return None if i < 0 else i
    stripped = text.lstrip()  # llama3_json: the whole answer is the call
    if stripped.startswith(_PYTHON_TAG) or stripped.startswith("{"):
        return len(text) - len(stripped)
    return None


def _held_back(text: str, mode: str) -> int:
    """Characters at the end of content that may begin a tool-call marker."""
    if mode == "hermes":
        for n in range(min(len(_HERMES_OPEN) - 1, len(text)), 0, -1):
            if _HERMES_OPEN.startswith(text[-n:]):
                return n
        return 0
    if mode == "llama3_json" and _PYTHON_TAG.startswith(text.strip()):
        return len(text)  # leading whitespace or part of the tag: the call may follow
    return 0


@dataclass
class ToolCallStreamer:
    """Splits one choice's streamed text into content and tool-call pieces.

    Invariant: ``content_sent`` characters of the text went out as content and, per call,
    ``args_sent[i]`` characters of its arguments; nothing sent is ever taken back."""

    mode: str
    text: str = ""
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        if self.mode.startswith("named:"):
            return None, self._named_pieces()
        start = calls_start(self.text, self.mode)
        end = len(self.text) if start is None else start
        if start is None and not finished:
            end -= _held_back(self.text, self.mode)
        content = self.text[self.content_sent:end]
        self.content_sent = max(self.content_sent, end)
        pieces = [] if start is None else self._pieces(self.text[start:])
        return content or None, pieces

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def _named_pieces(self) -> list[DeltaToolCall]:
        pieces = []
        if not self.ids:
            self.ids.append(new_call_id())
            self.args_sent.append(0)
            pieces.append(DeltaToolCall(index=0, id=self.ids[0], type="function",
                                        function=DeltaFunctionCall(name=self.mode[6:],
                                                                   arguments="")))
        new = self.text[self.args_sent[0]:]
        if new:
            self.args_sent[0] = len(self.text)
            pieces.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new)))
        return pieces

    def _pieces(self, region: str) -> list[DeltaToolCall]:
        pieces = []
        for i, call in enumerate(scan_calls(region)):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                pieces.append(DeltaToolCall(index=i, id=self.ids[i], type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments="")))
            end = call.arguments_end
            if end is None:  # still being written: everything after the head is arguments
                end = len(region)
                tail = region[call.arguments_start:]
                if self.mode == "hermes":
                    end -= _partial_suffix(tail, _HERMES_CLOSE)
            args = region[call.arguments_start:end]
            new = args[self.args_sent[i]:]
            if new:
                self.args_sent[i] = len(args)
                pieces.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return pieces


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker), len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# REASONING_PARSERS (pagellm.structured_outputs): "think", the answer starts with <think>
# (Qwen3, QwQ); "deepseek_r1", the chat template already opened <think>, so the answer is
# reasoning until </think> (DeepSeek-R1)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str, parser: str = "think") -> tuple[str | None, str]:
    """(reasoning, content) of an answer: the reasoning runs from ``<think>`` (``think``: it
    must open the answer; ``deepseek_r1``: optional) to ``</think>``, or to the end while
    unfinished; reasoning None when the answer has none."""
    stripped = text.lstrip()
    if stripped.startswith(_THINK_OPEN):
        body = stripped[len(_THINK_OPEN):]
    elif parser == "deepseek_r1":
        body = text
    else:
        return None, text
    reasoning, sep, content = body.partition(_THINK_CLOSE)
    return reasoning, content if sep else ""


@dataclass
class ReasoningStreamer:
    """The streamed form of ``split_reasoning``: feeds model text, returns (reasoning piece,
    content piece); holds back what may be the start of ``<think>`` or ``</think>``."""

    parser: str = "think"
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def feed(self, delta: str, finished: bool) -> tuple[str | None, str]:
        self.text += delta
        stripped = self.text.lstrip()
        if not finished and len(stripped) < len(_THINK_OPEN) \
                and _THINK_OPEN.startswith(stripped):
            return None, ""
        reasoning, content = split_reasoning(self.text, self.parser)
        if reasoning is None:
            new, self.content_sent = self.text[self.content_sent:], len(self.text)
            return None, new
        if _THINK_CLOSE not in self.text and not finished:
            reasoning = reasoning[:len(reasoning) - _partial_suffix(reasoning, _THINK_CLOSE)]
        new_reasoning = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        new_content = content[self.content_sent:]
        self.content_sent = len(content)
        return new_reasoning or None, new_content
