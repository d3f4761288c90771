"""Graceful shutdown: SIGTERM or SIGINT aborts the requests in flight, their streams end, and
the process exits with status 0. Each test starts (and stops) a server of its own."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_utils import MODEL_NAME, ServerProcess


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_aborts_in_flight_stream_and_exits_cleanly(tiny_model, tmp_path, sig):
    server = ServerProcess(tiny_model, tmp_path / "serve.log")
    server.wait_ready()
    events: list[dict | str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "tell me everything", "max_tokens": 480,
                "n": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body,
                          timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30), server.log()
    signalled_at = time.monotonic()
    code = server.stop(sig, timeout=30)
    reader.join(30)
    assert code == 0, server.log()
    assert time.monotonic() - signalled_at < 15
    assert events[-1] == "[DONE]"
    last = events[-2]
    # The stream ended early: an error event saying the server is shutting down.
    assert "error" in last and "shutting down" in last["error"]["message"], last
    assert "Traceback" not in server.log()
