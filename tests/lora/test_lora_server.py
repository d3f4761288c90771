"""LoRA adapters through the OpenAI server (a real ``pagellm serve`` subprocess): the openai
client selects an adapter by model name and gets transformers + peft's greedy tokens;
/v1/models lists the adapters; adapters load and unload at run time; unknown names are 404s."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
from server_utils import MODEL_NAME, ServerProcess  # noqa: E402

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_server(lora_zoo, tmp_path_factory):
    base, adapters = lora_zoo
    proc = ServerProcess(base, tmp_path_factory.mktemp("lora-logs") / "serve.log",
                         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                         "--lora-modules", f"all-r4={adapters['all-r4']}",
                         f"qv-r8-rslora={adapters['qv-r8-rslora']}")
    proc.wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, f"server exit status {code}:\n{proc.log()}"


@pytest.fixture()
def client(lora_server):
    from openai import OpenAI

    with OpenAI(base_url=f"{lora_server.url}/v1", api_key="none", max_retries=0,
                timeout=120) as c:
        yield c


def complete(client, model: str, prompt: list[int]):
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True})


def test_adapter_selected_by_model_name(client, lora_zoo, greedy_reference):
    from helpers import make_tokenizer

    tokenizer = make_tokenizer()
    prompt = [0, 57, 211, 98, 340, 17, 260]
    for model, name in [("all-r4", "all-r4"), (MODEL_NAME, None),
                        ("qv-r8-rslora", "qv-r8-rslora")]:
        response = complete(client, model, prompt)
        expected = tokenizer.decode(greedy_reference(name, prompt, MAX_TOKENS))
        assert response.choices[0].text == expected, model
        assert response.model == model
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_NAME, "all-r4", "qv-r8-rslora"]
    chat = client.chat.completions.create(model="all-r4", max_tokens=4,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.model == "all-r4" and chat.usage.completion_tokens >= 1


def test_unknown_model_is_404(client):
    import openai

    with pytest.raises(openai.NotFoundError) as error:
        complete(client, "no-such-adapter", [0, 5, 6])
    assert error.value.body["code"] == "model_not_found"


def test_load_and_unload_adapter(client, lora_server, lora_zoo, greedy_reference):
    _, adapters = lora_zoo
    url = lora_server.url
    path = str(adapters["mlp-r16-patterns"])
    loaded = httpx.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": "mlp", "lora_path": path}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    prompt = [0, 77, 12, 301, 45]
    from helpers import make_tokenizer

    response = complete(client, "mlp", prompt)
    expected = greedy_reference("mlp-r16-patterns", prompt, MAX_TOKENS)
    assert response.choices[0].text == make_tokenizer().decode(expected)
    assert "mlp" in [m.id for m in client.models.list().data]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "mlp",
                                                          "lora_path": path}, timeout=60)
    assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/load_lora_adapter",
                     json={"lora_name": "bad", "lora_path": "/no/such/folder"}, timeout=60)
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"},
                          timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert "mlp" not in [m.id for m in client.models.list().data]
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert gone.status_code == 404
    # the engine loop refreshes its stats right after the unload: poll for that snapshot
    expected = ['pagellm:lora_loads_total{model_name="tiny-llama"} 3.0',
                'pagellm:lora_adapters_registered{model_name="tiny-llama"} 2.0']
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        if all(line in metrics for line in expected) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(line in metrics for line in expected), metrics


def test_lora_modules_flag_is_checked():
    from pagellm.entrypoints.commands.serve import parse_lora_modules

    assert parse_lora_modules(["a=/x", "b=/y=z"]) == (("a", "/x"), ("b", "/y=z"))
    with pytest.raises(ValueError, match="--lora-modules 'nopath' is invalid: expected "
                                         "NAME=PATH"):
        parse_lora_modules(["nopath"])


def test_adapter_routes_without_enable_lora_are_400():
    """A server without --enable-lora (here over the in-process fake engine) refuses the
    adapter routes and treats an adapter name as an unknown model."""
    from server_fakes import FakeEngine
    from test_app_inprocess import call

    from pagellm.bench.random_model import build_tokenizer

    load, completion = call(FakeEngine(build_tokenizer(512, seed=0)), [
        ("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
        ("POST", "/v1/completions", {"model": "a", "prompt": "hi", "max_tokens": 2})])
    assert load.status_code == 400 and "--enable-lora" in load.json()["error"]["message"]
    assert completion.status_code == 404
    assert completion.json()["error"]["code"] == "model_not_found"
