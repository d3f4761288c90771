"""Malformed and hostile requests: each gets the right status and an OpenAI error body, the
server keeps serving, and no KV block leaks. Plus the API key on every /v1 route."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import API_KEY, MAX_MODEL_LEN, MODEL_NAME, wait_all_blocks_free

AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def cmpl(**fields):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **fields}


# (id, method, path, body: dict | bytes | None, status, param expected in the error or None)
CASES = [
    ("malformed-json", "POST", CMPL, b'{"prompt": "hi",', 400, None),
    ("json-array-body", "POST", CMPL, b"[1, 2, 3]", 400, None),
    ("deeply-nested-json", "POST", CMPL, b"[" * 100_000, 400, None),
    ("nan-temperature", "POST", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400,
     "temperature"),
    ("missing-prompt", "POST", CMPL, {"model": MODEL_NAME}, 400, "prompt"),
    ("missing-messages", "POST", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("temperature-string", "POST", CMPL, cmpl(temperature="hot"), 400, "temperature"),
    ("negative-temperature", "POST", CMPL, cmpl(temperature=-1), 400, "temperature"),
    ("top-p-zero", "POST", CMPL, cmpl(top_p=0), 400, "top_p"),
    ("top-p-above-one", "POST", CMPL, cmpl(top_p=1.5), 400, "top_p"),
    ("max-tokens-zero", "POST", CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-string", "POST", CMPL, cmpl(max_tokens="10"), 400, "max_tokens"),
    ("max-tokens-bool", "POST", CMPL, cmpl(max_tokens=True), 400, "max_tokens"),
    ("prompt-plus-max-tokens-too-long", "POST", CMPL, cmpl(max_tokens=MAX_MODEL_LEN), 400,
     None),
    ("prompt-too-long", "POST", CMPL, cmpl(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("second-prompt-too-long", "POST", CMPL, cmpl(prompt=[[5], [5] * MAX_MODEL_LEN]), 400,
     "prompt.1"),
    ("chat-too-long", "POST", CHAT, chat(messages=[{"role": "user", "content": "x " * 2000}]),
     400, "messages"),
    ("token-id-out-of-range", "POST", CMPL, cmpl(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("negative-token-id", "POST", CMPL, cmpl(prompt=[1, -2]), 400, "prompt"),
    ("mixed-prompt-list", "POST", CMPL, cmpl(prompt=[1, "a"]), 400, "prompt"),
    ("empty-prompt-string", "POST", CMPL, cmpl(prompt=""), 400, None),
    ("empty-prompt-list", "POST", CMPL, cmpl(prompt=[]), 400, "prompt"),
    ("unknown-model", "POST", CMPL, cmpl(model="gpt-9"), 404, "model"),
    ("n-zero", "POST", CMPL, cmpl(n=0), 400, "n"),
    ("n-too-large", "POST", CMPL, cmpl(n=100_000), 400, "n"),
    ("logprobs-too-many", "POST", CMPL, cmpl(logprobs=100), 400, "logprobs"),
    ("stop-empty-string", "POST", CMPL, cmpl(stop=[""]), 400, "stop"),
    ("stop-not-a-string", "POST", CMPL, cmpl(stop=5), 400, "stop"),
    ("presence-penalty-out-of-range", "POST", CMPL, cmpl(presence_penalty=5), 400,
     "presence_penalty"),
    ("min-tokens-above-max", "POST", CMPL, cmpl(min_tokens=10, max_tokens=2), 400,
     "min_tokens"),
    ("seed-overflow", "POST", CMPL, cmpl(seed=2**80), 400, "seed"),
    ("stop-token-out-of-vocab", "POST", CMPL, cmpl(stop_token_ids=[10**6]), 400,
     "stop_token_ids"),
    ("logit-bias-out-of-range", "POST", CMPL, cmpl(logit_bias={"5": 500.0}), 400,
     "logit_bias"),
    ("logit-bias-key-not-a-token", "POST", CMPL, cmpl(logit_bias={"x": 1.0}), 400,
     "logit_bias"),
    ("logit-bias-token-out-of-vocab", "POST", CMPL, cmpl(logit_bias={"1000000": 1.0}), 400,
     "logit_bias"),
    ("stream-options-without-stream", "POST", CMPL,
     cmpl(stream_options={"include_usage": True}), 400, "stream_options"),
    ("empty-messages", "POST", CHAT, chat(messages=[]), 400, "messages"),
    ("unknown-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages.0.role"),
    ("content-not-text", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400,
     None),
    ("image-content-part", "POST", CHAT,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
     400, "messages.0.content"),
    ("top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400,
     "top_logprobs"),
    ("chat-max-completion-tokens-negative", "POST", CHAT, chat(max_completion_tokens=-1), 400,
     "max_tokens"),
    ("body-too-large", "POST", CMPL, b" " * (17 << 20), 413, None),
    ("unknown-route", "GET", "/v1/engines", None, 404, None),
    ("unknown-top-level-route", "POST", "/admin", {}, 404, None),
    ("wrong-method", "GET", CMPL, None, 405, None),
]


def assert_error_body(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_openai_error(server, case):
    _, method, path, body, status, param = case
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    if body is None:
        kwargs = {}
    response = httpx.request(method, server.url + path, headers=JSON, timeout=30, **kwargs)
    assert_error_body(response, status, param)


def test_a_content_part_not_text_is_named(server):
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    response = httpx.post(server.url + CHAT, headers=JSON, timeout=30,
                          json=chat(messages=[{"role": "user", "content": parts}]))
    assert_error_body(response, 400, "messages.0.content")
    assert response.json()["error"]["message"] == (
        "invalid value for 'messages.0.content': content[1] is type 'input_audio': the model "
        "takes text only, parts of the form {'type': 'text', 'text': ...}")


def test_text_parts_are_joined_by_newlines(server):
    """As vLLM joins them for a template that reads content as a string."""
    def ask(content):
        body = chat(messages=[{"role": "user", "content": content}], temperature=0)
        response = httpx.post(server.url + CHAT, headers=JSON, timeout=60, json=body)
        assert response.status_code == 200, response.text
        out = response.json()
        return out["usage"]["prompt_tokens"], out["choices"][0]["message"]["content"]

    parts = [{"type": "text", "text": "What is the capital"},
             {"type": "text", "text": "of France?"}]
    assert ask(parts) == ask("What is the capital\nof France?")


def test_server_still_serves_and_leaks_no_block_after_bad_requests(server, client):
    assert len(CASES) >= 20
    for _, method, path, body, _, _ in CASES:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        httpx.request(method, server.url + path, headers=JSON, timeout=30,
                      **(kwargs if body is not None else {}))
    out = client.completions.create(model=MODEL_NAME, prompt="still alive?", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    stats = wait_all_blocks_free(server)
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None),
    ("POST", CMPL, cmpl()),
    ("POST", CHAT, chat()),
])
def test_api_key_required_on_v1_routes(server, method, path, body):
    url = server.url + path
    missing = httpx.request(method, url, json=body)
    assert_error_body(missing, 401, None)
    wrong = httpx.request(method, url, json=body, headers={"Authorization": "Bearer nope"})
    assert_error_body(wrong, 401, None)
    ok = httpx.request(method, url, json=body, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text


def test_openai_client_with_wrong_key_raises_authentication_error(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == MODEL_NAME


def test_health_needs_no_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
