"""Online serving benchmark against any OpenAI-compatible server (``/v1/completions``, streamed).

Requests arrive as a Poisson process at ``request_rate`` per second (exponential gaps, seeded),
or all at once when the rate is infinite; ``max_concurrency`` caps the requests in flight. Each
request streams its completion; the client times every chunk that carries text:

- TTFT: from sending the request to its first text chunk;
- ITL: the gaps between consecutive text chunks (one chunk per token on vLLM-like servers);
- TPOT: (end-to-end - TTFT) / (output tokens - 1), per request;
- end-to-end latency: from sending to the last byte.

Output tokens are the server's ``usage.completion_tokens`` when it reports usage, else the number
of text chunks. Requests ask for ``ignore_eos`` (a vLLM extension) so that outputs have their
stated length.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pagellm.bench.workloads import BenchRequest


@dataclass(slots=True)
class RequestRecord:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class ServingConfig:
    base_url: str
    model: str
    endpoint: str = "/v1/completions"
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    seed: int = 0
    prompt_format: str = "token_ids"  # or "text"
    timeout_s: float = 600.0


def arrival_gaps(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (Poisson arrivals), or none."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError(f"request_rate={request_rate} must be > 0 (or inf)")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num_requests)]


def _payload(config: ServingConfig, request: BenchRequest) -> dict[str, Any]:
    prompt: Any = request.prompt if config.prompt_format == "text" else request.prompt_token_ids
    return {"model": config.model, "prompt": prompt, "max_tokens": request.output_len,
            "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}


async def send_request(client, config: ServingConfig, request: BenchRequest) -> RequestRecord:
    record = RequestRecord(ok=False, prompt_len=request.prompt_len)
    chunk_times: list[float] = []
    usage_tokens = None
    start = time.perf_counter()
    try:
        async with client.stream("POST", config.base_url.rstrip("/") + config.endpoint,
                                 json=_payload(config, request)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:300]}"
                return record
            async for line in response.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    record.prompt_len = chunk["usage"].get("prompt_tokens", record.prompt_len)
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    chunk_times.append(time.perf_counter())
    except Exception as exc:  # network errors are results, not crashes of the benchmark
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    end = time.perf_counter()
    return _finish_record(record, start, end, chunk_times, usage_tokens)


def _finish_record(record: RequestRecord, start: float, end: float, chunk_times: list[float],
                   usage_tokens: int | None) -> RequestRecord:
    record.ok = True
    record.e2e_s = end - start
    record.output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    if chunk_times:
        record.ttft_s = chunk_times[0] - start
        record.itl_s = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    if record.ttft_s is not None and record.output_tokens > 1:
        record.tpot_s = (record.e2e_s - record.ttft_s) / (record.output_tokens - 1)
    return record


async def run_serving(config: ServingConfig, requests: list[BenchRequest]
                      ) -> tuple[list[RequestRecord], float]:
    """Send every request on the arrival schedule; return the records and the duration."""
    import httpx

    gaps = arrival_gaps(len(requests), config.request_rate, config.seed)
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    limits = httpx.Limits(max_connections=config.max_concurrency or len(requests))

    async def one(client, request: BenchRequest) -> RequestRecord:
        if limit is None:
            return await send_request(client, config, request)
        async with limit:
            return await send_request(client, config, request)

    async with httpx.AsyncClient(timeout=config.timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for gap, request in zip(gaps, requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, request)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(records), duration


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    import numpy as np

    ms = np.asarray(values) * 1000.0
    return {"mean": round(float(ms.mean()), 3), "median": round(float(np.median(ms)), 3),
            "p99": round(float(np.percentile(ms, 99)), 3)}


def summarize(config: ServingConfig, records: list[RequestRecord], duration: float
              ) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    duration = max(duration, 1e-9)
    return {
        "base_url": config.base_url, "model": config.model, "endpoint": config.endpoint,
        "request_rate": "inf" if config.request_rate == float("inf") else config.request_rate,
        "max_concurrency": config.max_concurrency,
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": round(duration, 3),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": round(len(ok) / duration, 3),
        "output_token_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((prompt_tokens + output_tokens) / duration, 2),
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok if r.e2e_s is not None]),
        "requests": [asdict(r) for r in records],
    }


def benchmark_serving(config: ServingConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    records, duration = asyncio.run(run_serving(config, requests))
    return summarize(config, records, duration)


def first_served_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    import httpx

    response = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=timeout_s)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --served-model-name")
    return models[0]["id"]
