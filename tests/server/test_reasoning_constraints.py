"""Structured outputs under a reasoning parser: the constraint holds for the answer after the
reasoning, which is free text (as vLLM applies structured outputs once the reasoning has
ended). The grammar is compiled as the server compiles it; a real ``pagellm serve`` shows
that a constrained request may reason first unless --structured-outputs-in-reasoning."""
from __future__ import annotations

import json
from dataclasses import replace

import openai
import pytest
from server_utils import MODEL_NAME, ServerProcess
from test_strict_tool_calls import accepts, compiler  # noqa: F401 (compiler: a fixture)

from pagellm.entrypoints.openai.protocol import Tool
from pagellm.entrypoints.openai.tool_calls import (extract_calls, forced_call_grammar,
                                                   split_reasoning)
from pagellm.structured_outputs import StructuredOutputsParams

pytest.importorskip("llguidance")

N_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}
TIME = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"],
    "additionalProperties": False}}


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=N_SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "choice": StructuredOutputsParams(choice=["yes", "no"]),
    "regex": StructuredOutputsParams(regex="[0-9]{4}"),
    "lark": StructuredOutputsParams(grammar='start: "a" "b"+'),
    "gbnf": StructuredOutputsParams(grammar='root ::= "a" "b"+'),
}
ANSWERS = {"json": ('{"n":1}', '{"n":"one"}'), "json_object": ('{"k":[1]}', "[1]"),
           "choice": ("no", "maybe"), "regex": ("2026", "20x6"), "lark": ("abb", "ba"),
           "gbnf": ("ab", "a")}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_think_reasoning_is_free_and_optional(compiler, kind):
    params = replace(CONSTRAINTS[kind], reasoning="think")
    good, bad = ANSWERS[kind]
    for text, ok in [
        (good, True), (bad, False),
        (f"<think>Any text: {bad} {{ [ </think>{good}", True),
        (f" <think>\nplan\n</think>\n\n{good}", True),  # whitespace around, as models write it
        (f"<think>plan</think>{bad}", False),
        ("<think>still thinking", False),  # an answer is due: the model may not stop here
        (f"<think>a</think>{good}</think>", False),
        (f"{good}<think>b</think>", False),
    ]:
        assert accepts(compiler, params, text) is ok, text
        if ok:  # the reasoning parser finds the constrained answer as the content
            assert split_reasoning(text, "think")[1].strip() == good


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_deepseek_r1_answer_follows_the_closing_tag(compiler, kind):
    params = replace(CONSTRAINTS[kind], reasoning="deepseek_r1")
    good, bad = ANSWERS[kind]
    for text, ok in [
        (f"Let me see. {bad} </think>\n\n{good}", True),
        (f"</think>{good}", True),
        (f"<think>plan</think>{good}", True),
        (good, False),  # the template opened <think>: this is reasoning, unfinished
        (f"plan</think>{bad}", False),
        ("all reasoning", False),
    ]:
        assert accepts(compiler, params, text) is ok, text
        if ok:
            assert split_reasoning(text, "deepseek_r1")[1].strip() == good


def test_without_a_parser_the_constraint_starts_at_the_first_token(compiler):
    params = CONSTRAINTS["choice"]
    assert accepts(compiler, params, "yes")
    assert not accepts(compiler, params, "<think>x</think>yes")


def test_a_forced_call_may_follow_reasoning(compiler):
    tools = [Tool.model_validate({"type": "function", "function": TIME})]
    params = replace(forced_call_grammar(tools, None, False), reasoning="think")
    text = '<think>Oslo is +1.</think>\n[{"name":"get_time","arguments":{"zone":1}}]'
    assert accepts(compiler, params, text)
    assert not accepts(compiler, params, '<think>x</think>[{"name":"get_time",'
                                         '"arguments":{"zone":"one"}}]')
    content, (call,) = extract_calls(split_reasoning(text, "think")[1], "required")
    assert content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": 1})


def test_reasoning_is_part_of_the_compiled_grammar_s_identity(compiler):
    before = compiler.num_compiled
    plain = StructuredOutputsParams(regex="[a-z]{3}")
    compiler.compile(plain)
    compiler.compile(replace(plain, reasoning="think"))
    compiler.compile(replace(plain, reasoning="deepseek_r1"))
    compiler.compile(replace(plain, reasoning="think"))  # cached
    assert compiler.num_compiled == before + 3


def test_an_unknown_reasoning_parser_is_refused():
    with pytest.raises(ValueError, match="structured_outputs.reasoning must be one of think, "
                                         "deepseek_r1 or None, got 'r2'"):
        StructuredOutputsParams(choice=["a"], reasoning="r2")


# ---------------------------------------------------------------------- through the server
def steered_to_reasoning(tokenizer) -> dict[str, int]:
    """logit_bias that makes every token starting like "yes", "no" or whitespace the least
    likely: a model that may reason must then open <think>, one that may not must still
    answer yes or no (the grammar leaves it nothing else)."""
    return {str(i): -100 for i in range(len(tokenizer))
            if tokenizer.decode([i])[:1] in ("y", "n", " ", "\n", "\t")}


CHOICE = {"structured_outputs": {"choice": ["yes", "no"]}}


@pytest.fixture(scope="module")
def reasoning_server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("reasoning") / "serve.log",
                         "--reasoning-parser", "think")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_server_lets_a_constrained_answer_reason_first(reasoning_server, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    with openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="none", max_retries=0,
                       timeout=120) as client:
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Is it raining?"}],
            max_tokens=12, temperature=0.0, logit_bias=steered_to_reasoning(tokenizer),
            extra_body=CHOICE)
    choice = out.choices[0]
    assert choice.message.model_extra["reasoning_content"] is not None, choice.message
    assert choice.finish_reason == "length"
