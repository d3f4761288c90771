"""Builders for tests: tiny seeded random-weight models of every supported architecture, saved
as real Hugging Face folders (config.json, safetensors, tokenizer), and transformers references.

    path = make_tiny_model(tmp_path, "Qwen3ForCausalLM", head_dim=32)   # -> folder
    tokenizer = AutoTokenizer.from_pretrained(path)                      # works, chat template too
    tokens = hf_greedy(load_hf_model(path), prompt_ids, 32)              # transformers reference

Why the weights are scaled: with transformers' default init (std 0.02) a random model's greedy
output collapses into one repeated token, so "same greedy tokens" would prove little. Matrices
drawn with std 0.3 give varied tokens, so a wrong position, mask, block lookup or rotary angle
changes them. Same arguments and seed give the same weights and tokenizer.

The tokenizer is a byte-level BPE trained on a small built-in text: it encodes any string
(bytes are its base alphabet) and every model id decodes (ids the training did not reach are
filled with ``<extra_N>`` tokens). Ids 0, 1, 2 are ``<s>`` (BOS, prepended on encode),
``</s>`` (EOS) and ``<pad>``. It has a chat template:
``<|user|>\\nHi</s>\\n<|assistant|>\\n``.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

# hidden 64, 2 layers, 4 heads over 2 KV heads (grouped-query attention), vocab 512.
TINY_CONFIG: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
    bos_token_id=0, eos_token_id=1,
)
# Per-architecture defaults on top of TINY_CONFIG; callers' overrides win.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {"sliding_window": None},
    "Qwen2ForCausalLM": {"tie_word_embeddings": True},
    "Qwen3ForCausalLM": {"head_dim": 32},  # != hidden / heads, as in real Qwen3 configs
}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_CORPUS = """\
PagedAttention stores the KV cache in fixed-size blocks, like pages of virtual memory.
Each sequence has a block table mapping its logical blocks to physical blocks.
The scheduler batches requests continuously and preempts them when memory runs out.
Hello world! What is the capital of France? Paris is the capital of France.
Tell me a story about a cat who learned to read. Once upon a time, there was a cat.
user assistant system: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 2048 3.14
"""


def tiny_config(arch: str = "LlamaForCausalLM", **overrides: Any) -> Any:
    """A transformers config of the tiny model of ``arch`` (e.g. "Qwen2ForCausalLM")."""
    import transformers

    if arch not in ARCH_DEFAULTS:
        raise ValueError(f"no tiny config for {arch!r}; known: {sorted(ARCH_DEFAULTS)}")
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_class(**{**TINY_CONFIG, **ARCH_DEFAULTS[arch], **overrides})
    config.architectures = [arch]
    return config


def make_tiny_model(tmp_dir: str | Path, arch: str = "LlamaForCausalLM", *, seed: int = 0,
                    std: float = 0.3, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, name: str | None = None,
                    **overrides: Any) -> Path:
    """Save a seeded random-weight model of ``arch`` with a tokenizer; return its folder.

    ``overrides`` are config fields (``num_hidden_layers=1``, ``tie_word_embeddings=False``,
    ``rope_parameters={...}``, ``sliding_window=48`` ...). ``max_shard_size`` (e.g. "100KB")
    writes a sharded checkpoint with ``model.safetensors.index.json``. The folder is
    ``tmp_dir / name`` (default: the architecture name).
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    scale_weights(model, std, seed)
    out = Path(tmp_dir) / (name or arch)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(out, **kwargs)
    make_tokenizer(config.vocab_size).save_pretrained(out)
    return out


def scale_weights(model: torch.nn.Module, std: float = 0.3, seed: int = 0) -> None:
    """Matrices ~ N(0, std); norm weights ~ U(0.8, 1.2); biases ~ N(0, std / 3). Seeded."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                values = torch.randn(param.shape, generator=gen) * std
            elif "norm" in name:
                values = 0.8 + 0.4 * torch.rand(param.shape, generator=gen)
            else:
                values = torch.randn(param.shape, generator=gen) * (std / 3)
            param.copy_(values)


def make_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE PreTrainedTokenizerFast with exactly ``vocab_size`` ids (>= 300)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials), got {vocab_size}")
    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    base.train_from_iterator(_CORPUS.splitlines(), trainer)
    base.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base, bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>")
    missing = vocab_size - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<extra_{i}>" for i in range(missing)])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers model of a folder, in eval mode, for reference outputs."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_prompt_logits(hf_model: Any, prompt: list[int]) -> torch.Tensor:
    """float32 logits [len(prompt), vocab] of every prompt position."""
    return hf_model(torch.tensor([prompt])).logits[0].float()


@torch.inference_mode()
def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int,
              return_logprobs: bool = False, return_logits: bool = False) -> Any:
    """transformers' greedy continuation of one unpadded prompt, EOS ignored.

    Runs the model's own incremental decoding (its KV cache, ``past_key_values``) one token at
    a time; ``generate`` is not used because it stops at EOS, which random models emit.
    With ``return_logprobs``: (tokens, log-probability of each chosen token); with
    ``return_logits`` as well: (tokens, logprobs, float32 logits [max_new_tokens, vocab]).
    """
    out = hf_model(torch.tensor([prompt]), use_cache=True)
    cache_arg = _cache_argument(hf_model)
    tokens: list[int] = []
    logprobs: list[float] = []
    rows: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        last = out.logits[0, -1].float()  # [vocab]
        token = int(last.argmax())
        tokens.append(token)
        rows.append(last)
        logprobs.append(float(torch.log_softmax(last, -1)[token]))
        out = hf_model(torch.tensor([[token]]), use_cache=True,
                       **{cache_arg: out.past_key_values})
    if return_logits:
        return tokens, logprobs, torch.stack(rows)
    return (tokens, logprobs) if return_logprobs else tokens


def _cache_argument(hf_model: Any) -> str:
    """transformers >= 5.x names the forward's KV cache argument ``cache``, older ones
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(hf_model.forward).parameters \
        else "past_key_values"


def random_prompts(lengths: list[int], vocab_size: int = 512, seed: int = 0,
                   prefix: list[int] | None = None) -> list[list[int]]:
    """Seeded random token prompts of the given lengths (ids >= 3: no special tokens),
    each starting with ``prefix`` when given (its length counts toward ``lengths``)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = prefix or []
    return [prefix + torch.randint(3, vocab_size, (n - len(prefix),), generator=gen).tolist()
            for n in lengths]


def is_gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status or "\nState:\tX" in status


def wait_gone(pids: int | list[int], timeout: float) -> bool:
    """Whether the processes all exit within ``timeout`` seconds (children see their parent's
    exit only a moment after it)."""
    pids = [pids] if isinstance(pids, int) else pids
    deadline = time.monotonic() + timeout
    while not all(is_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def assert_compiles(script: str) -> None:
    """Run ``script`` (it compiles Triton kernels for a GPU target, which needs no GPU) in a
    fresh interpreter without TRITON_INTERPRET; it prints "compiled", or "SKIP ..." where the
    toolchain is missing (then the test is skipped)."""
    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env,
                            capture_output=True, text=True, timeout=300)
    if result.stderr.startswith("SKIP") or result.stdout.startswith("SKIP"):
        pytest.skip(result.stderr.strip() or result.stdout.strip())
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
