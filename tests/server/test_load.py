"""Under load and disconnects: many streaming clients share the engine's steps and get their own
correct tokens; a client that goes away in mid-stream has its request aborted and its KV
blocks freed at once; afterwards every block is free."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
from server_utils import API_KEY, MODEL_NAME, get_stats, wait_all_blocks_free

from pagellm import SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _seq_ids_of(stats: dict, request_id: str) -> list[int]:
    """/stats names no request (ids belong to their clients): the block counts of the
    sequences running, which in these tests are the request's own."""
    return stats["seq_block_counts"]


def test_disconnect_mid_stream_frees_blocks_at_once(server):
    body = {"model": MODEL_NAME, "prompt": "A long story: " * 8, "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            request_id = json.loads(first[len("data: "):])["id"]
            for _ in range(3):
                next(lines)
            # /stats is a snapshot the engine loop refreshes between steps: poll (bounded)
            deadline = time.monotonic() + 10
            while not _seq_ids_of(during := get_stats(server), request_id):
                assert time.monotonic() < deadline, "the running request never held blocks"
                time.sleep(0.02)
            assert during["num_free_blocks"] < during["num_blocks"]
        # Leaving the block closes the connection in mid-stream.
        closed_at = time.monotonic()
        stats = wait_all_blocks_free(server, timeout=5)
        freed_after = time.monotonic() - closed_at
    assert not _seq_ids_of(stats, request_id)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_requests_in_flight"] == 0
    assert freed_after < 5
    # The request was aborted, not run to its 400 tokens.
    assert stats["generation_tokens_total"] - during["generation_tokens_total"] < 300


def test_disconnect_before_non_streamed_response_aborts(server):
    """A plain (non-streamed) request is aborted when its client hangs up while it runs."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "Another long story", "n": 2,
                       "max_tokens": 480, "ignore_eos": True}).encode()
    before = _successes(server)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 10
        while not get_stats(server)["seq_block_counts"]:
            assert time.monotonic() < deadline, "the request never started"
    stats = wait_all_blocks_free(server, timeout=5)
    assert stats["num_free_blocks"] == stats["num_blocks"]
    assert stats["num_requests_in_flight"] == 0
    assert _successes(server) == before, "the request ran to the end instead of aborting"


def _successes(server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pagellm:request_success_total"))


def test_fifty_concurrent_streaming_clients(server, reference_llm):
    prompts = [f"Request {i}: explain block tables in {i % 7 + 1} words." for i in range(50)]
    max_tokens = [8 + i % 9 for i in range(50)]
    expected = reference_llm.generate(
        prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                  for m in max_tokens], use_tqdm=False)
    before = get_stats(server)
    results = asyncio.run(_stream_all(server.url, prompts, max_tokens))
    for i, (text, usage, finish) in enumerate(results):
        assert text == expected[i].outputs[0].text, f"client {i}"
        assert usage == max_tokens[i] and finish == "length"
    stats = wait_all_blocks_free(server)
    assert stats["num_free_blocks"] == stats["num_blocks"], stats
    assert not stats["seq_block_counts"] and stats["num_running"] == 0
    assert stats["num_waiting"] == 0 and stats["num_requests_in_flight"] == 0
    # Continuous batching across clients: far fewer steps than tokens generated.
    steps = stats["num_steps"] - before["num_steps"]
    assert steps < sum(max_tokens) / 4, steps


async def _stream_all(url: str, prompts: list[str], max_tokens: list[int]):
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=300) as client:
        async def one(prompt: str, limit: int):
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=limit, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return text, usage, finish

        return await asyncio.gather(*(one(p, m) for p, m in zip(prompts, max_tokens)))
