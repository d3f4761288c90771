"""``pagellm serve -tp 2``: the model split over two ranks (a worker process beside the
server) answers the official openai client with the tokens of the single-rank engine, and
stopping the server stops its worker."""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import is_gone, wait_gone
from server_utils import MODEL_NAME, ServerProcess

from pagellm import SamplingParams


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


@pytest.fixture(scope="module")
def tp_server(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("tp") / "serve.log", "-tp", "2")
    proc.wait_ready()
    yield proc
    workers = child_pids(proc.proc.pid)
    code = proc.stop()
    assert code == 0, f"server exit status {code}:\n{proc.log()}"
    assert wait_gone(workers, 10.0), [p for p in workers if not is_gone(p)]


def test_tensor_parallel_server_answers_the_openai_client(tp_server, reference_llm):
    from openai import OpenAI

    assert len(child_pids(tp_server.proc.pid)) >= 1  # the rank-1 worker
    prompt = "The scheduler batches requests"
    expected = reference_llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    with OpenAI(base_url=f"{tp_server.url}/v1", api_key="none", max_retries=0,
                timeout=120) as client:
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
            temperature=0.0, max_tokens=8, stream=True)
        chunks = list(stream)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == 16
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
