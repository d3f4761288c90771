"""Seeded random-weight models with a working tokenizer, built locally (nothing downloaded).

Used by ``make demo``, the benchmarks and the tests. The tokenizer is a byte-level BPE whose
vocabulary covers every id of the model (trained merges from a small built-in corpus, then
deterministic synthetic merges up to ``vocab_size``), so any generated id decodes to text.

Weights are scaled well above transformers' default init (std 0.02): with the default a random
model's greedy output collapses into one repeated token, which would let a wrong position, mask
or block lookup go unnoticed.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SMALL_LLAMA = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                   num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                   max_position_embeddings=2048)
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                  max_position_embeddings=1024)
# The small model's 12 layers at widths where arithmetic is negligible: its decode forward
# time is the Python, the ctypes calls and the op dispatch of a step (benchmarks/engine_step.py).
NARROW_LLAMA = dict(hidden_size=128, num_hidden_layers=12, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=256, vocab_size=512,
                    max_position_embeddings=1024)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_CORPUS = """PagedAttention splits the KV cache into fixed-size blocks, like pages of virtual memory.
Each sequence has a block table that maps its logical blocks to physical blocks.
The block allocator hands out free blocks on demand and reclaims them when a sequence finishes.
Sequences that share a system prompt share its blocks through reference counts.
When memory runs out the scheduler swaps a low-priority sequence out to CPU memory.
Continuous batching adds and removes sequences at every iteration of the engine.
Explain how PagedAttention works. What is the capital of France? Tell me a story about a cat.
大模型推理过程中，KV Cache内存消耗是制约吞吐量的核心瓶颈。分页管理将显存划分为固定大小的块。
The quick brown fox jumps over the lazy dog. 🙂 Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2048.
"""


def build_tokenizer(vocab_size: int, seed: int = 0):
    """A PreTrainedTokenizerFast whose vocabulary is exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    base.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    spec = json.loads(base.to_str())
    _pad_merges(spec["model"], vocab_size, seed)
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != vocab_size:
        raise ValueError(f"tokenizer has {len(fast)} tokens, wanted {vocab_size}")
    return fast


def _pad_merges(model: dict[str, Any], vocab_size: int, seed: int) -> None:
    """Add merges of random token pairs until the vocabulary has ``vocab_size`` entries."""
    vocab: dict[str, int] = model["vocab"]
    merges: list = model["merges"]
    rng = random.Random(seed)
    symbols = [t for t in vocab if t not in SPECIAL_TOKENS]
    while len(vocab) < vocab_size:
        left, right = rng.choice(symbols), rng.choice(symbols)
        merged = left + right
        if merged in vocab or len(merged) > 16:
            continue
        vocab[merged] = len(vocab)
        merges.append([left, right] if merges and isinstance(merges[0], list)
                      else f"{left} {right}")
        symbols.append(merged)


def build_random_model(out_dir: str | Path, architecture: str = "LlamaForCausalLM",
                       seed: int = 0, std: float = 0.3, dtype: str = "float32",
                       **config_overrides: Any) -> Path:
    """Write a seeded random-weight HF model (config.json, safetensors, tokenizer) to out_dir."""
    import torch
    import transformers

    out_dir = Path(out_dir)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    fields = {**TINY_LLAMA, **config_overrides}
    tie = fields.pop("tie_word_embeddings", False)
    config = config_cls(**fields, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
            elif "norm" in name:
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, std)
    model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(config.vocab_size, seed).save_pretrained(out_dir)
    (out_dir / "RANDOM_WEIGHTS.txt").write_text(
        f"Random weights (seed {seed}, std {std}); not a trained model.\n")
    return out_dir


def cached_demo_model(cache_dir: str | Path, name: str = "demo-llama", **overrides: Any) -> Path:
    """Build the demo model once (seeded) under cache_dir and reuse it afterwards."""
    path = Path(cache_dir) / name
    if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
        tmp = path.with_name(path.name + ".tmp")
        build_random_model(tmp, **overrides)
        tmp.rename(path)
    return path
