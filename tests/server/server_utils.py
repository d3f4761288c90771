"""Helpers for the server tests: engine settings shared by the server and the offline
reference, a ``pagellm serve`` subprocess, and /stats polling."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key-123"
MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 256
# Float32 so that greedy tokens do not depend on how requests were batched; a small swap space
# so that the server does not set aside gigabytes of CPU memory.
ENGINE_KWARGS = dict(dtype="float32", num_gpu_blocks_override=NUM_BLOCKS,
                     max_model_len=MAX_MODEL_LEN, swap_space=0.05)
ENGINE_FLAGS = ["--dtype", "float32", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                "--max-model-len", str(MAX_MODEL_LEN), "--swap-space", "0.05"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PAGELLM_API_KEY", None)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["OMP_NUM_THREADS"] = "1"
    return env


class ServerProcess:
    """``pagellm serve`` in a subprocess; its output goes to a log file shown on failure."""

    def __init__(self, model: Path, log_path: Path, *extra: str,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pagellm", "serve", str(model), "--port", str(self.port),
               "--served-model-name", MODEL_NAME, "--uvicorn-log-level", "warning",
               *ENGINE_FLAGS, *extra]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env or cli_env())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def get_stats(server) -> dict:
    """/stats (with the API key, which a server without one ignores)."""
    return httpx.get(f"{server.url}/stats", headers=AUTH, timeout=10).json()


def wait_all_blocks_free(server, timeout: float = 10.0) -> dict:
    """Poll /stats until no sequence holds a block; returns the last snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_stats(server)
        if stats["num_free_blocks"] == stats["num_blocks"] and not stats["seq_block_counts"]:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
