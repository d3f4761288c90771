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
