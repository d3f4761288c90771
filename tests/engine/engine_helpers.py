"""Helpers for the engine tests: model variants, a transformers reference, prompts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import helpers
import torch

ARCH_OVERRIDES = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"tie_word_embeddings": True},
    "Qwen3ForCausalLM": {"head_dim": 24},
}


def with_eos(model_dir: Path, eos_token_id: int, out_dir: Path) -> Path:
    """A copy of a model folder whose config names another EOS token."""
    shutil.copytree(model_dir, out_dir)
    for name in ("config.json", "generation_config.json"):
        path = out_dir / name
        if path.exists():
            data = json.loads(path.read_text())
            data["eos_token_id"] = eos_token_id
            path.write_text(json.dumps(data))
    return out_dir


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              return_logprobs: bool = False):
    """Greedy continuation of each prompt by transformers, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results, all_logprobs = [], []
    for prompt in prompts:
        tokens, _, logits = helpers.hf_greedy(model, prompt, max_tokens, return_logits=True)
        results.append(tokens)
        all_logprobs.append(list(torch.log_softmax(logits, -1)))
    return (results, all_logprobs) if return_logprobs else results


def make_prompts(count: int, lengths: list[int], seed: int = 0, vocab: int = 512,
                 shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist()
            for i in range(count)]
