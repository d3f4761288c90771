"""Nothing a client sends stops the engine or stalls other clients (a real ``pagellm serve``).

One server for the module, with two API keys, per-key prefix cache isolation and short
head/body timeouts so that the slow-client cases finish in seconds. Every loop is bounded.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from server_utils import MODEL_NAME, ServerProcess

KEY_A, KEY_B = "key-alpha", "key-beta"
AUTH = {"Authorization": f"Bearer {KEY_A}"}
HEAD_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def hardened(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("hostile") / "serve.log",
                         "--api-key", KEY_A, KEY_B, "--prefix-cache-isolation", "api-key",
                         "--header-timeout", str(HEAD_TIMEOUT),
                         "--body-timeout", str(BODY_TIMEOUT))
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def post(server, path: str, body, key: str = KEY_A, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(server.url + path, content=body, headers=headers, timeout=timeout)
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], (word, error)
    return error


def assert_serving(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    ok = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "still here",
                                          "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- requests that killed the engine
@pytest.mark.parametrize("fields,param", [
    ({"prompt": "hello hello world", "temperature": 1.0, "repetition_penalty": 1e-300},
     "repetition_penalty"),
    ({"prompt": "hello hello world", "temperature": 1.0, "repetition_penalty": 1e-46},
     "repetition_penalty"),
    ({"prompt": "hello", "temperature": 1e300, "min_tokens": 2}, "temperature"),
    ({"prompt": "hello", "max_tokens": 5, "temperature": 1.0, "min_tokens": 3,
      "stop_token_ids": list(range(512))}, "min_tokens"),
])
def test_requests_that_broke_the_sampler_are_refused(hardened, fields, param):
    body = {"model": MODEL_NAME, "max_tokens": 3, **fields}
    error = assert_openai_error(post(hardened, "/v1/completions", body), 400)
    assert error["param"] == param, error
    assert_serving(hardened)


def test_lone_surrogates_are_a_400_everywhere(hardened):
    bad = b'"\\ud800abc"'
    for path, body in [
        ("/v1/completions", b'{"model": "%s", "prompt": %s}' % (MODEL_NAME.encode(), bad)),
        ("/tokenize", b'{"prompt": "\\ud800"}'),
        ("/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}' % bad),
    ]:
        assert_openai_error(post(hardened, path, body), 400, "lone UTF-16 surrogate")
    assert_serving(hardened)


# ---------------------------------------------------------------- nothing stalls the event loop
def _max_health_latency(server, work) -> float:
    """Run ``work`` in a thread while polling /health; the slowest /health answer, in s."""
    done = threading.Event()
    result = {}

    def run():
        try:
            result["response"] = work()
        finally:
            done.set()

    thread = threading.Thread(target=run)
    slowest = 0.0
    with httpx.Client(timeout=30) as http:
        thread.start()
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            start = time.monotonic()
            assert http.get(f"{server.url}/health").status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.01)
    thread.join(60)
    return slowest, result["response"]


@pytest.mark.parametrize("path,body,words", [
    ("/tokenize", {"prompt": "hello world " * 500_000}, ["characters", "max_model_len"]),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hello world " * 500_000},
     ["characters", "max_model_len"]),
    ("/detokenize", {"tokens": [5] * 2_000_000}, ["2000000 token ids", "512"]),
    # ~12 MB of small messages: validating them took seconds of the event loop
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2,
                              "messages": [{"role": "user", "content": "hi there"}] * 300_000},
     ["300001 JSON objects", "limit of 20000"]),
    ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}] * 300_000}]},
     ["300002 JSON objects", "limit of 20000"]),
])
def test_huge_inputs_are_refused_without_stalling_others(hardened, path, body, words):
    payload = json.dumps(body).encode()
    slowest, response = _max_health_latency(hardened, lambda: post(hardened, path, payload))
    assert_openai_error(response, 400, *words)
    assert slowest < 1.0, f"/health took {slowest:.2f} s"


def test_many_stop_strings_are_refused(hardened):
    body = {"model": MODEL_NAME, "prompt": "hi", "stop": [f"s{i}" for i in range(300_000)]}
    assert_openai_error(post(hardened, "/v1/completions", body), 400, "at most 16")


# ---------------------------------------------------------------- the HTTP layer
def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_response(sock: socket.socket, limit: float = 10) -> bytes:
    sock.settimeout(limit)
    data = b""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        data += chunk
    return data


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_slow_heads_and_bodies_are_closed(hardened):
    start = time.monotonic()
    socks = [_connect(hardened) for _ in range(20)]
    for i, sock in enumerate(socks):
        if i % 2:  # half send part of a head, the others a head and part of a body
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        else:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + KEY_A.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"pro")
    for sock in socks:
        with sock:
            status, error = _status_and_error(_read_response(sock))
            assert status == 408 and "did not arrive" in error["message"]
    assert time.monotonic() - start < HEAD_TIMEOUT + BODY_TIMEOUT + 8
    assert_serving(hardened)


def test_over_long_header_block_gets_a_json_error(hardened):
    """A request head over h11's limit (16 KiB while incomplete) is refused in JSON."""
    with _connect(hardened) as sock:
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, error = _status_and_error(_read_response(sock))
    assert status == 400 and "header block" in error["message"]


def test_chunked_body_over_the_limit_is_a_413(hardened):
    chunk = b" " * (1 << 20)
    with _connect(hardened) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     + KEY_A.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(50):  # 50 MiB, far over the 16 MiB default
                sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read what it said
        status, error = _status_and_error(_read_response(sock))
    assert status == 413 and "exceeds the limit" in error["message"]


# ---------------------------------------------------------------- what one tenant sees of another
@pytest.mark.parametrize("method,path,body", [
    ("GET", "/stats", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]}),
])
def test_every_route_but_health_needs_a_key(hardened, method, path, body):
    response = httpx.request(method, hardened.url + path, json=body, timeout=10)
    assert_openai_error(response, 401, "API key")
    for key in (KEY_A, KEY_B):
        ok = httpx.request(method, hardened.url + path, json=body, timeout=10,
                           headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200, ok.text


def test_no_local_path_and_no_request_id_leaks(hardened, tiny_model):
    models = httpx.get(f"{hardened.url}/v1/models", headers=AUTH, timeout=10).text
    unknown = post(hardened, "/tokenize", {"model": "nope", "prompt": "x"})
    error = assert_openai_error(unknown, 404, "does not exist")
    assert error["code"] == "model_not_found"
    for text in (models, unknown.text):
        assert str(tiny_model) not in text
    body = {"model": MODEL_NAME, "prompt": "a long one", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{hardened.url}/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        request_id = json.loads(first[len("data: "):])["id"]
        stats = httpx.get(f"{hardened.url}/stats", headers=AUTH, timeout=10).text
    assert request_id not in stats and "cmpl-" not in stats


def _prefix_hits(server) -> int:
    return httpx.get(f"{server.url}/stats", headers=AUTH, timeout=10).json()["prefix_cache_hits"]


def test_prefix_cache_is_isolated_per_api_key(hardened):
    prompt = [7 + (i % 100) for i in range(100)]  # several full blocks
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    assert post(hardened, "/v1/completions", body, KEY_A).status_code == 200
    before = _prefix_hits(hardened)
    assert post(hardened, "/v1/completions", body, KEY_B).status_code == 200
    assert _prefix_hits(hardened) == before, "key B reused key A's cached prefix"
    assert post(hardened, "/v1/completions", body, KEY_A).status_code == 200
    assert _prefix_hits(hardened) > before, "key A's own prefix was not reused"


# ---------------------------------------------------------------- a second server: no key,
# prefix cache isolated per `user` field, room for two connections
@pytest.fixture(scope="module")
def per_user(tiny_model, tmp_path_factory):
    proc = ServerProcess(tiny_model, tmp_path_factory.mktemp("per-user") / "serve.log",
                         "--prefix-cache-isolation", "user", "--limit-concurrency", "2")
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


def test_prefix_cache_is_isolated_per_user_field(per_user):
    prompt = [9 + (i % 90) for i in range(100)]

    def complete(user: str) -> None:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "user": user}
        assert httpx.post(per_user.url + "/v1/completions", json=body,
                          timeout=60).status_code == 200

    def hits() -> int:
        return httpx.get(f"{per_user.url}/stats", timeout=10).json()["prefix_cache_hits"]

    complete("alice")
    before = hits()
    complete("bob")
    assert hits() == before, "bob reused alice's cached prefix"
    complete("alice")
    assert hits() > before, "alice's own prefix was not reused"


def test_connections_past_the_limit_get_a_json_503(per_user):
    """--limit-concurrency 2: with two connections open, a third client's request is refused
    with an OpenAI-style 503 at once; once they close, it is served."""
    idle = [_connect(per_user) for _ in range(2)]
    try:
        time.sleep(0.2)
        refused = httpx.get(f"{per_user.url}/v1/models", timeout=10)
    finally:
        for sock in idle:
            sock.close()
    assert_openai_error(refused, 503, "connection limit")
    deadline = time.monotonic() + 10
    while httpx.get(f"{per_user.url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.get(f"{per_user.url}/v1/models", timeout=10).status_code == 200
