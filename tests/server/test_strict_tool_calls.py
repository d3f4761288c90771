"""``strict: true`` functions under ``tool_choice="auto"``: the grammar of
tool_calls.strict_call_grammar, compiled as the server compiles it, lets the model write free
text or calls in the parser's format, and every call it lets through parses and, for a strict
function, validates against the function's schema."""
from __future__ import annotations

import json
import random

import pytest

from pagellm.bench.random_model import build_tokenizer
from pagellm.entrypoints.openai.protocol import Tool
from pagellm.entrypoints.openai.tool_calls import extract_calls, strict_call_grammar
from pagellm.structured_outputs import GrammarCompiler
from pagellm.worker.grammar import unpack_bitmask

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

WEATHER = {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"], "additionalProperties": False}}
LOOSE = {"name": "search", "parameters": {"type": "object",
                                          "properties": {"q": {"type": "string"}}}}
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
GOOD = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'


def tools(*functions: dict) -> list[Tool]:
    return [Tool.model_validate({"type": "function", "function": f}) for f in functions]


@pytest.fixture(scope="module")
def compiler():
    tokenizer = build_tokenizer(512)
    return GrammarCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def accepts(compiler, params, text: str) -> bool:
    """Whether the grammar lets the model write ``text`` and then stop."""
    matcher = compiler.new_matcher(params)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_no_strict_function_means_no_grammar():
    assert strict_call_grammar(tools(LOOSE), "hermes", True) is None
    assert strict_call_grammar(tools({**WEATHER, "strict": False}), "llama3_json", True) is None


@pytest.mark.parametrize("text, ok", [
    ("I cannot call anything for that.", True),
    ("", True),
    (f"Sure. <tool_call>\n{GOOD}\n</tool_call>", True),
    (f"<tool_call>{GOOD}</tool_call><tool_call>"
     '{"name": "get_time", "arguments": {"zone": -3}}</tool_call> done', True),
    ('<tool_call>{"name": "search", "arguments": {"q": 1, "x": [true]}}</tool_call>', True),
    # the schema of a strict function is enforced, and only the given functions can be named
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', False),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": 13}}</tool_call>', False),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', False),
    ('<tool_call>{"name": "search", "arguments": "q"}</tool_call>', False),
    # a tag anywhere in the text opens a call: there is no way around the grammar
    ("Sure. <tool_call>I changed my mind", False),
    (f"<tool_call>{GOOD}</tool_call> and <tool_call>oops", False),
    (f"<tool_call>{GOOD}", False),  # unfinished: the model may not stop here
])
def test_hermes_grammar(compiler, text, ok):
    params = strict_call_grammar(tools(WEATHER, TIME, LOOSE), "hermes", True)
    assert accepts(compiler, params, text) is ok


def test_hermes_without_parallel_calls_stops_after_one(compiler):
    params = strict_call_grammar(tools(WEATHER, TIME), "hermes", False)
    one = f"Sure. <tool_call>\n{GOOD}\n</tool_call>"
    assert accepts(compiler, params, one)
    assert not accepts(compiler, params, one + " more")
    assert not accepts(compiler, params, one + f"<tool_call>{GOOD}</tool_call>")


@pytest.mark.parametrize("text, parallel, ok", [
    ("It is sunny in Oslo.", True, True),
    (' {"name": "get_time", "parameters": {"zone": 1}}', False, True),
    ('{"name": "get_time", "parameters": {"zone": 1}}; '
     '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "f"}}', True, True),
    ('{"name": "get_time", "parameters": {"zone": 1}}; '
     '{"name": "get_time", "parameters": {"zone": 2}}', False, False),
    ('{"name": "get_time", "parameters": {"zone": "one"}}', True, False),
    ('{"name": "get_time", "arguments": {"zone": 1}}', True, False),  # llama3 says parameters
    ('  {"anything": 1}', True, False),  # an answer that starts like a call is one
    ('<|python_tag|>{"anything": 1}', True, False),
])
def test_llama3_json_grammar(compiler, text, parallel, ok):
    params = strict_call_grammar(tools(WEATHER, TIME), "llama3_json", parallel)
    assert accepts(compiler, params, text) is ok


@pytest.mark.parametrize("parser, reasoning, text, ok", [
    # think: an optional leading <think>...</think>, where a call tag is only text
    ("hermes", "think", f"<think>I could write <tool_call> here.</think>Sure. "
     f"<tool_call>{GOOD}</tool_call>", True),
    ("hermes", "think", "<think>Nothing to call.</think>It is sunny.", True),
    ("hermes", "think", f"<tool_call>{GOOD}</tool_call>", True),
    ("hermes", "think", "<think>Still thinking <tool_call>", True),  # unfinished reasoning
    ("hermes", "think", "<think>x</think> <tool_call>oops", False),
    ("llama3_json", "think", '<think>Oslo.</think>\n{"name": "get_time", '
     '"parameters": {"zone": 1}}', True),
    ("llama3_json", "think", '<think>Oslo.</think>{"name": "get_time"}', False),
    # deepseek_r1: the template opened <think>; the reasoning runs to </think>, or to the end
    ("hermes", "deepseek_r1", f"Plan: <tool_call> maybe.</think>\n<tool_call>{GOOD}"
     "</tool_call>", True),
    ("hermes", "deepseek_r1", "All reasoning, <tool_call> included", True),
    ("hermes", "deepseek_r1", "Done.</think>Sure <tool_call>oops", False),
    ("llama3_json", "deepseek_r1", 'ok</think>{"name": "get_time", "parameters": '
     '{"zone": 99}}', False),
])
def test_reasoning_is_free_text(compiler, parser, reasoning, text, ok):
    params = strict_call_grammar(tools(WEATHER, TIME), parser, True, reasoning)
    assert accepts(compiler, params, text) is ok


def random_walk(compiler, params, prefix: str, rng: random.Random, max_tokens: int = 300):
    """A model that, after ``prefix``, picks uniformly among the tokens the grammar allows
    (EOS, when allowed, with probability 0.3): the text, or None past ``max_tokens``."""
    import llguidance.torch

    tokenizer, eos = compiler.tokenizer, compiler.eos_token_id
    matcher = compiler.new_matcher(params)
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    assert matcher.consume_tokens(ids)
    bitmask = llguidance.torch.allocate_token_bitmask(1, compiler.vocab_size)
    for _ in range(max_tokens):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = unpack_bitmask(bitmask, compiler.vocab_size)[0].nonzero().flatten().tolist()
        if eos in allowed and (len(allowed) == 1 or rng.random() < 0.3):
            return tokenizer.decode(ids)
        token = rng.choice([t for t in allowed if t != eos])
        assert matcher.consume_token(token)
        ids.append(token)
    return None


def test_every_call_a_random_model_can_write_parses_and_validates(compiler):
    """Forty random walks that open a call: each ends in calls that parse, name a function and
    carry arguments its schema accepts."""
    params = strict_call_grammar(tools(WEATHER, TIME), "hermes", True)
    rng = random.Random(0)
    finished = 0
    for _ in range(40):
        text = random_walk(compiler, params, "Let me look. <tool_call>", rng)
        if text is None:
            continue
        finished += 1
        content, calls = extract_calls(text, "hermes")
        assert content == "Let me look." and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])
    assert finished >= 30


# ------------------------------------------------------------------- through a real server
@pytest.fixture(scope="module")
def llama3_server(tiny_model, tmp_path_factory):
    from server_utils import ServerProcess

    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("strict") / "serve.log",
                         "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                         "--max-model-len", "1024")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def ask(server, tiny_model, functions, **kw):
    import httpx
    from server_utils import MODEL_NAME
    from transformers import AutoTokenizer

    (brace,) = AutoTokenizer.from_pretrained(str(tiny_model)).encode(
        "{", add_special_tokens=False)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [{"type": "function", "function": f} for f in functions],
            "tool_choice": "auto", "max_tokens": 150, "temperature": 1.0,
            # the random model answers "{{{...": the start of a llama3 call
            "logit_bias": {str(brace): 100}, **kw}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)


def test_server_enforces_strict_functions_in_auto_mode(llama3_server, tiny_model):
    for seed in range(3):
        r = ask(llama3_server, tiny_model, [WEATHER, TIME], seed=seed,
                parallel_tool_calls=False)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
    # the same request without strict: nothing constrains the braces, and nothing parses
    loose = [{**f, "strict": False} for f in (WEATHER, TIME)]
    choice = ask(llama3_server, tiny_model, loose, seed=0).json()["choices"][0]
    assert not choice["message"].get("tool_calls")
    assert choice["message"]["content"].startswith("{{")


@pytest.mark.parametrize("change, param, message", [
    ({"response_format": {"type": "json_object"}}, "tools",
     "tools with strict: true cannot be combined with response_format"),
    ({"tools": [{"type": "function", "function": {**TIME, "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/missing"}}}}}]},
     "tools.0.function.parameters",
     "function 'get_time' has strict: true, but its parameters schema cannot be enforced"),
])
def test_server_refuses_strict_functions_it_cannot_enforce(llama3_server, tiny_model, change,
                                                          param, message):
    r = ask(llama3_server, tiny_model, [TIME], **change)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"]
    assert ask(llama3_server, tiny_model, [TIME], seed=0).status_code == 200  # still serving
