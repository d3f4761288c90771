"""request_body.py: bodies parsed as FastAPI would, with a bound on the JSON objects that
reach pydantic."""
from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError

from pagellm.entrypoints.openai import request_body
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


def chat(messages: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}] * messages}).encode()


def test_the_object_limit_counts_every_dict_at_any_depth():
    limit = request_body.MAX_JSON_OBJECTS
    assert request_body.count_objects({"a": [1, {"b": {}}, [[{}]]], "c": "{}"}) == 4
    parsed = request_body.parse_body(chat(limit - 1), ChatCompletionRequest)  # + the top
    assert len(parsed.messages) == limit - 1
    with pytest.raises(APIError, match=rf"holds {limit + 1} JSON objects, more than the "
                                       rf"limit of {limit} \(--max-request-json-objects\)"):
        request_body.parse_body(chat(limit), ChatCompletionRequest)
    assert len(request_body.parse_body(chat(limit), ChatCompletionRequest, limit + 1).messages)


def test_errors_are_fastapi_s_validation_errors_under_body():
    with pytest.raises(RequestValidationError) as bad_json:
        request_body.parse_body(b'{"prompt": "hi",', CompletionRequest)
    assert bad_json.value.errors()[0]["type"] == "json_invalid"
    with pytest.raises(RequestValidationError) as bad_field:
        request_body.parse_body(b'{"prompt": "hi", "n": "many"}', CompletionRequest)
    assert bad_field.value.errors()[0]["loc"] == ("body", "n")
    with pytest.raises(APIError, match="nested too deeply"):
        request_body.parse_body(b"[" * 100_000, CompletionRequest)
