"""Tool-call and reasoning parsing without a server: the streamed pieces, fed in chunks of
every size, add up to what the whole text parses to."""
from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.tool_calls import (ReasoningStreamer, ToolCallStreamer,
                                                   extract_calls, split_reasoning)

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"nested": {"a": [1, 2, "}"]}}}\n</tool_call>\n<tool_call>{"name": "get_time", '
          '"arguments": {}}</tool_call>')
LLAMA3 = ' <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; ' \
         '{"name": "get_time", "parameters": {"zone": 1}}'
REQUIRED = '[{"name":"get_weather","arguments":{"city":"Rome"}},' \
           '{"name":"get_time","arguments":{"zone":-3}}]'


def stream(text: str, mode: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    streamer = ToolCallStreamer(mode)
    content, calls = "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        text_piece, deltas = streamer.feed(piece, i == len(pieces) - 1)
        content += text_piece or ""
        for d in deltas:
            call = calls.setdefault(d.index, ["", ""])
            if d.function.name:
                assert not call[0]
                call[0] = d.function.name
            call[1] += d.function.arguments or ""
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("text,mode,content", [(HERMES, "hermes", "Let me check."),
                                               (LLAMA3, "llama3_json", None),
                                               (REQUIRED, "required", None)])
def test_streamed_pieces_add_up_to_the_parsed_calls(text, mode, content):
    whole_content, calls = extract_calls(text, mode)
    assert whole_content == content
    expected = [(c.function.name, c.function.arguments) for c in calls]
    assert len(expected) == 2 and all(json.loads(args) is not None for _, args in expected)
    for size in (1, 2, 3, 7, len(text)):
        streamed_content, streamed = stream(text, mode, size)
        assert streamed == expected, size
        assert streamed_content.strip() == (content or "")


def test_hermes_arguments_keep_their_text():
    _, calls = extract_calls(HERMES, "hermes")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris",
                                                       "nested": {"a": [1, 2, "}"]}}
    assert calls[1].function.arguments == "{}"


def test_text_without_calls_is_content():
    for mode in ("hermes", "llama3_json"):
        assert extract_calls("Just an answer.", mode) == ("Just an answer.", [])
        assert stream("Just an answer <b>", mode, 1) == ("Just an answer <b>", [])
    broken = '<tool_call>{"name": "f", "arguments": {"a": </tool_call>'
    assert extract_calls(broken, "hermes") == (broken, [])


def test_named_call_streams_everything_as_arguments():
    content, calls = stream('{"zone": 5}', "named:get_time", 2)
    assert content == "" and calls == [("get_time", '{"zone": 5}')]


@pytest.mark.parametrize("parser", ["think", "deepseek_r1"])
@pytest.mark.parametrize("text", ["<think>step one\nstep two</think>\nThe answer",
                                  "No thinking here", "<think>unfinished thought",
                                  "opened by the template</think>answer", "<thi"])
def test_reasoning_streamed_equals_split(text, parser):
    expected = split_reasoning(text, parser)
    for size in (1, 2, 5, len(text)):
        streamer, reasoning, content = ReasoningStreamer(parser), "", ""
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            r, c = streamer.feed(piece, i == len(pieces) - 1)
            reasoning += r or ""
            content += c
        assert (reasoning if expected[0] is not None else None, content) == expected, size


def test_reasoning_parsers_differ_on_an_answer_without_the_opening_tag():
    text = "hmm</think>Paris"
    assert split_reasoning(text, "think") == (None, text)
    assert split_reasoning(text, "deepseek_r1") == ("hmm", "Paris")
    assert split_reasoning("<think>a</think>b", "think") == ("a", "b")
