"""``pagellm serve model.gguf``: the official openai client gets a correct streamed chat answer
from the real SmolLM2-135M-Instruct GGUF file (its tokenizer and chat template come from the
file)."""
from __future__ import annotations

import pytest

pytest.importorskip("gguf")

from gguf_models import smollm2_gguf
from server_utils import MODEL_NAME, ServerProcess


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    proc = ServerProcess(smollm2_gguf(), tmp_path_factory.mktemp("gguf") / "serve.log")
    proc.wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, f"server exit status {code}:\n{proc.log()}"


def test_streamed_chat_answer(gguf_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{gguf_server.url}/v1", api_key="none", max_retries=0,
                timeout=120) as client:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        stream = client.chat.completions.create(model=MODEL_NAME, messages=question,
                                                temperature=0.0, max_tokens=32, stream=True)
        chunks = list(stream)
        models = client.models.list().data
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."  # float32: transformers' greedy answer
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3
    assert models[0].id == MODEL_NAME and str(smollm2_gguf()) not in models[0].root  # no path


PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "city": {"type": "string", "maxLength": 40}},
          "required": ["name", "age", "city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current temperature in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}


def test_real_model_json_schema_and_tool_call_round_trip(gguf_server):
    import json

    from openai import OpenAI

    jsonschema = pytest.importorskip("jsonschema")
    with OpenAI(base_url=f"{gguf_server.url}/v1", api_key="none", max_retries=0,
                timeout=120) as client:
        ask = [{"role": "user", "content": "Describe a person who lives in Paris as JSON."}]
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=ask, temperature=0.0, max_tokens=80,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)

        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(
            model=MODEL_NAME, messages=question, temperature=0.0, max_tokens=60,
            tools=[WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False)
        message = first.choices[0].message
        (call,) = message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER_TOOL["function"]["parameters"])
        history = question + [message, {"role": "tool", "tool_call_id": call.id,
                                        "content": '{"celsius": 21}'}]
        final = client.chat.completions.create(
            model=MODEL_NAME, messages=history, temperature=0.0, max_tokens=40,
            tools=[WEATHER_TOOL], tool_choice="none")
    assert final.choices[0].message.content.strip()
    assert not final.choices[0].message.tool_calls
