"""Fixtures for the server tests.

The fake-engine tests get a tokenizer. The others start ``pagellm serve`` as a real subprocess
on a free loopback port with a tiny seeded random-weight model, and compare what it says with
the offline ``LLM`` on the same weights and engine arguments. One server (with an API key)
serves every module that does not stop it, so it starts once per session.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from server_utils import API_KEY, ENGINE_KWARGS, ServerProcess

from pagellm.bench.random_model import build_random_model, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer(512, seed=0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("server") / "tiny", seed=1)


@pytest.fixture(scope="session")
def reference_llm(tiny_model):
    """The offline API on the same weights and engine arguments as the server."""
    from pagellm import LLM

    return LLM(str(tiny_model), **ENGINE_KWARGS)


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    """A server with an API key, shared by the modules that leave it running."""
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("logs") / "serve.log",
                         "--api-key", API_KEY)
    proc.wait_ready()
    yield proc
    code = proc.stop()
    assert code == 0, f"server exit status {code}:\n{proc.log()}"


@pytest.fixture()
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                timeout=120) as c:
        yield c
