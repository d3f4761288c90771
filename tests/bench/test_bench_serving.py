"""``bench serving`` against a tiny in-test OpenAI-style server that streams one token a chunk."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagellm.bench.serving import ServingConfig, arrival_gaps, benchmark_serving
from pagellm.bench.workloads import WorkloadSpec, build_workload


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams ``max_tokens`` chunks of text then a usage chunk; 400 for empty prompts."""

    protocol_version = "HTTP/1.1"
    in_flight = 0
    peak_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not request["prompt"]:
            body = b'{"error": {"message": "empty prompt", "type": "BadRequestError"}}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.peak_in_flight = max(cls.peak_in_flight, cls.in_flight)
        try:
            self._stream(request)
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def _stream(self, request):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = request["max_tokens"]
        for i in range(n):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": len(request["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


@pytest.fixture()
def fake_server():
    _FakeOpenAI.peak_in_flight = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _requests(n=12):
    spec = WorkloadSpec(num_prompts=n, input_len=(4, 16), output_len=(2, 9), seed=1)
    return build_workload(spec, vocab_size=100).requests


def test_serving_metrics_and_accounting(fake_server):
    requests = _requests()
    config = ServingConfig(base_url=fake_server, model="fake-model", max_concurrency=3,
                           request_rate=200.0)
    report = benchmark_serving(config, requests)
    assert report["completed"] == len(requests) and report["failed"] == 0
    assert report["output_tokens"] == sum(r.output_len for r in requests)
    assert report["prompt_tokens"] == sum(r.prompt_len for r in requests)
    assert _FakeOpenAI.peak_in_flight <= 3
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) == {"mean", "median", "p99"}
        assert report[key]["mean"] is not None and report[key]["mean"] >= 0
    for record, request in zip(report["requests"], requests):
        assert len(record["itl_s"]) == request.output_len - 1
        assert record["ttft_s"] <= record["e2e_s"]


def test_failed_requests_are_counted_not_raised(fake_server):
    requests = _requests(3)
    requests[1].prompt_token_ids = []
    report = benchmark_serving(ServingConfig(base_url=fake_server, model="m"), requests)
    assert report["completed"] == 2 and report["failed"] == 1
    assert "HTTP 400" in report["errors"][0]


def test_poisson_gaps_are_seeded():
    assert arrival_gaps(5, float("inf"), 0) == [0.0] * 5
    gaps = arrival_gaps(2000, 10.0, seed=7)
    assert gaps == arrival_gaps(2000, 10.0, seed=7)
    assert 0.08 < sum(gaps) / len(gaps) < 0.12


def test_cli_serving_writes_json_and_plot(fake_server, tmp_path, tiny_model):
    from pagellm.entrypoints.cli import main

    out, plot = tmp_path / "serving.json", tmp_path / "latency.png"
    code = main(["bench", "serving", "--base-url", fake_server, "--tokenizer", str(tiny_model),
                 "--num-prompts", "6", "--input-len", "4,12", "--output-len", "2,6",
                 "--max-concurrency", "2", "--output-json", str(out), "--plot", str(plot)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["model"] == "fake-model" and report["completed"] == 6
    assert report["output_tokens"] == report["workload"]["output_tokens_total"]
    assert plot.stat().st_size > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_against_pagellm_serve(tiny_model, tmp_path):
    """The client and ``pagellm serve`` agree on the protocol: token-id prompts, ignore_eos,
    streamed usage; every requested token arrives."""
    import os
    import subprocess
    import sys
    import time

    import httpx

    port = _free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "pagellm", "serve", str(tiny_model), "--port", str(port),
         "--dtype", "float32", "--num-gpu-blocks-override", "128", "--swap-space", "0.01",
         "--disable-log-stats", "--uvicorn-log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.time() > deadline:
                pytest.fail("pagellm serve did not start: " + server.stderr.read().decode()[-2000:])
            time.sleep(0.2)
        from pagellm.bench.serving import first_served_model

        requests = _requests(8)
        config = ServingConfig(base_url=base_url, model=first_served_model(base_url),
                               max_concurrency=4)
        report = benchmark_serving(config, requests)
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert report["failed"] == 0, report["errors"]
    assert report["output_tokens"] == sum(r.output_len for r in requests)
    assert report["prompt_tokens"] == sum(r.prompt_len for r in requests)
    assert report["ttft_ms"]["median"] is not None and report["itl_ms"]["median"] is not None
