"""The HTTP layer over a fake engine, in-process: the error paths a real tiny model cannot be
driven into on demand (a request the engine gives up on, an engine that died)."""
from __future__ import annotations

import asyncio
import json

import httpx
from server_fakes import FakeEngine

from pagellm.core.async_engine import AsyncLLMEngine
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.metrics import EngineMetrics

UNFITTABLE = "this prompt never fits"
FAULTY = "this prompt meets an engine fault"


def call(fake: FakeEngine, requests: list[tuple[str, str, dict | None]]) -> list[httpx.Response]:
    async def main():
        metrics = EngineMetrics("fake")
        engine = AsyncLLMEngine(fake, on_step=metrics.observe_step)
        app = build_app(engine, ["fake"], metrics)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
                out = []
                for method, path, body in requests:
                    out.append(await c.request(method, path, json=body))
                    await asyncio.sleep(0.05)
                return out

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_request_the_engine_gives_up_on_is_a_400(tokenizer):
    fake = FakeEngine(tokenizer, unfittable_prompt=UNFITTABLE)
    plain, streamed, ok = call(fake, [
        ("POST", "/v1/completions", {"prompt": UNFITTABLE, "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": UNFITTABLE, "max_tokens": 4, "stream": True}),
        ("POST", "/v1/completions", {"prompt": "fine", "max_tokens": 4}),
    ])
    assert plain.status_code == 400
    assert "cannot fit in the KV cache" in plain.json()["error"]["message"]
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    assert "cannot fit" in json.loads(events[-2])["error"]["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_request_failed_by_an_engine_fault_is_a_500(tokenizer):
    """A step that failed for the engine's own reasons ends its requests with a 500
    (server_error), plain and streamed, and the server goes on serving."""
    fake = FakeEngine(tokenizer, faulty_prompt=FAULTY)
    plain, streamed, ok = call(fake, [
        ("POST", "/v1/completions", {"prompt": FAULTY, "max_tokens": 4}),
        ("POST", "/v1/completions", {"prompt": FAULTY, "max_tokens": 4, "stream": True}),
        ("POST", "/v1/completions", {"prompt": "fine", "max_tokens": 4}),
    ])
    assert plain.status_code == 500, plain.text
    assert plain.json()["error"]["type"] == "server_error"
    assert "engine step failed" in plain.json()["error"]["message"]
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "engine step failed" in error["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_dead_engine_answers_503(tokenizer):
    fake = FakeEngine(tokenizer, fail_on_step=1)
    first, health, later = call(fake, [
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}),
        ("GET", "/health", None),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ])
    assert first.status_code == 503 and "engine loop failed" in first.json()["error"]["message"]
    assert health.status_code == 503 and later.status_code == 503
    assert later.json()["error"]["type"] == "service_unavailable"


def test_openapi_document_describes_the_bodies_parsed_off_the_loop(tokenizer):
    """The routes take their bodies through request_body.BodyParser, not FastAPI's own
    parameters; /openapi.json still names each body's schema, its nested models included."""
    document = call(FakeEngine(tokenizer), [("GET", "/openapi.json", None)])[0].json()
    schemas = document["components"]["schemas"]
    for path, model, field in (("/v1/completions", "CompletionRequest", "model"),
                               ("/v1/chat/completions", "ChatCompletionRequest", "model"),
                               ("/tokenize", "TokenizeRequest", "model"),
                               ("/detokenize", "DetokenizeRequest", "model"),
                               ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest", "lora_name")):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert field in schemas[model]["properties"]
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    assert "role" in schemas["ChatMessage"]["properties"]
