"""Session fixtures for the model tests: tiny random models of every supported architecture
(and rope variants), built once, plus transformers references computed once per model."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import hf_greedy, hf_prompt_logits, load_hf_model, make_tiny_model, random_prompts

# name -> (architecture, config overrides)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-bias": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "mistral-sliding": ("MistralForCausalLM", {"sliding_window": 48}),
    "qwen2-tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen2-untied": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
}
# One batch of mixed lengths, 1 to 300 tokens, run together.
PROMPT_LENGTHS = [1, 7, 33, 150, 300]
MAX_NEW_TOKENS = 32


class Reference:
    """transformers outputs for one model, computed on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._model: dict[torch.dtype, Any] = {}
        self._greedy: dict[tuple, Any] = {}

    def model(self, dtype: torch.dtype = torch.float32) -> Any:
        if dtype not in self._model:
            self._model[dtype] = load_hf_model(self.path, dtype)
        return self._model[dtype]

    def greedy(self, prompt: list[int], dtype: torch.dtype = torch.float32,
               max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[list[int], list[float]]:
        tokens, logprobs, _ = self.greedy_logits(prompt, dtype, max_new_tokens)
        return tokens, logprobs

    def greedy_logits(self, prompt: list[int], dtype: torch.dtype = torch.float32,
                      max_new_tokens: int = MAX_NEW_TOKENS
                      ) -> tuple[list[int], list[float], torch.Tensor]:
        """greedy() and the float32 logits [max_new_tokens, vocab] each token came from."""
        key = (tuple(prompt), dtype, max_new_tokens)
        if key not in self._greedy:
            self._greedy[key] = hf_greedy(self.model(dtype), prompt, max_new_tokens,
                                          return_logits=True)
        return self._greedy[key]

    def prompt_logits(self, prompt: list[int]) -> torch.Tensor:
        return hf_prompt_logits(self.model(), prompt)


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Tiny models run fastest on one thread, and a shared machine's other load makes
    multi-threaded tiny ops stall on each other (a 7x slowdown measured at load 5)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_zoo(tmp_path_factory):
    """zoo(name) -> (model folder, Reference), built on first request."""
    built: dict[str, tuple[Path, Reference]] = {}

    def get(name: str) -> tuple[Path, Reference]:
        if name not in built:
            arch, overrides = VARIANTS[name]
            path = make_tiny_model(tmp_path_factory.mktemp("models"), arch, name=name,
                                   seed=sum(map(ord, name)), **overrides)
            built[name] = (path, Reference(path))
        return built[name]

    return get


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=1)

