"""Engine arguments: the user's knobs, validated with errors that name the value and its limit.

The names and meanings follow vLLM's ``EngineArgs`` so that a vLLM user only changes the import.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# On the CPU, without kv_cache_memory_bytes, the KV cache takes this share of the RAM that is
# available at start-up: enough for hundreds of concurrent sequences of a small model while
# leaving the rest to weights, activations and the swap space.
CPU_KV_CACHE_RAM_SHARE = 0.10
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
MAX_LORA_RANK = 512
_GiB = 1 << 30
# vLLM's (and torch's) other spellings of the dtypes
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                 "fp32": "float32"}
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# weight-only formats (model/layers/quantized_linear.py); "gguf": a GGUF file's blocks as
# they are (model/gguf_loader.gguf_method)
QUANTIZATION_METHODS = (None, "int8", "int4", "gguf")


@dataclass(slots=True)
class EngineArgs:
    """Everything ``LLM(...)`` and ``pagellm serve`` accept (see README for defaults)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    device: str = "auto"
    tensor_parallel_size: int = 1
    # How the tensor-parallel ranks run: "mp" (worker processes on this host) or "ray"
    # (Ray actors, on one host or a Ray cluster). See docs/TENSOR_PARALLEL.md.
    distributed_executor_backend: str = "mp"
    gpu_memory_utilization: float = 0.90
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    block_size: int = 16
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out blocks
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str | None = None  # "swap", "recompute", or None: swap while there is room
    scheduling_policy: str = "fcfs"  # or "priority"
    # "paged" (pagellm) or "contiguous": the max-length reservation baseline, for comparisons.
    kv_allocator: str = "paged"
    allow_pickle_weights: bool = False
    watermark: float = 0.01
    # "auto": the model's generation_config.json gives the default temperature/top_p/top_k/
    # min_p/repetition_penalty of requests that do not set them; "vllm": the engine's own
    # defaults; or a folder holding a generation_config.json (see model/generation_config.py).
    generation_config: str = "auto"
    # On CUDA, decode steps replay CUDA graphs captured at start-up (worker/cuda_graphs.py);
    # on the CPU they call the layers' kernels in a row where the model allows it
    # (worker/cpu_decode.py). True runs every step through the layers' forward.
    enforce_eager: bool = False
    # LoRA adapters (docs/LORA.md): max_loras adapters on the device at once (one step uses
    # at most that many), of rank <= max_lora_rank; max_cpu_loras loaded in CPU memory
    # (default: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # KV cache storage: "auto" (the model dtype) or 8-bit "int8", "fp8" (= "fp8_e4m3"),
    # "fp8_e5m2", with a scale per token and KV head (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    # Weight-only quantization of the linear layers on load: None, "int8" (per output
    # channel; a GGUF file's blocks as they are), "int4" (groups of
    # quantization_group_size input columns) or "gguf" (a GGUF file's blocks as they are,
    # each projection in the smallest format that holds them exactly); see
    # model/layers/quantized_linear.py
    quantization: str | None = None
    # None: 32 for a GGUF file (its Q4 blocks' groups), else 128, or 64 or 32 where 128
    # does not divide a projection's input width (quantized_model.default_group_size)
    quantization_group_size: int | None = None
    # With quantization="int4", "int8" or "gguf": multiply the int4 weights (and, with
    # AVX512-VNNI, the symmetric int8 ones; a model with no layer that takes them here is
    # refused: int8 without those loops) by activations rounded to int8 codes per 32
    # columns (a float32 scale each), with integer dot products, as llama.cpp's Q4 x Q8 and
    # Q8 x Q8 products do: faster small-batch decode on the CPU, at the cost of the
    # activations' rounding (quant_matmul.quantize_activations)
    int8_activations: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field, its value and its limit."""
        _check(isinstance(self.model, str) and self.model.strip() != "", "model", self.model,
               "a local folder or a hub id")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        _choice("dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _int_at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        _choice("distributed_executor_backend", self.distributed_executor_backend, ("mp", "ray"))
        _check(isinstance(self.gpu_memory_utilization, (int, float))
               and 0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1]")
        if self.kv_cache_memory_bytes is not None:
            _int_at_least("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.num_gpu_blocks_override is not None:
            _int_at_least("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
        if self.max_model_len is not None:
            _int_at_least("max_model_len", self.max_model_len, 1)
        if self.max_num_batched_tokens is not None:
            _int_at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _int_at_least("max_num_seqs", self.max_num_seqs, 1)
        _int_at_least("block_size", self.block_size, 1)
        _check(self.block_size <= 1024, "block_size", self.block_size, "must be <= 1024")
        _check(isinstance(self.swap_space, (int, float)) and self.swap_space >= 0, "swap_space",
               self.swap_space, "must be >= 0 (GiB)")
        _check(isinstance(self.seed, int), "seed", self.seed, "must be an integer")
        _choice("preemption_mode", self.preemption_mode, (None, "swap", "recompute"))
        _choice("scheduling_policy", self.scheduling_policy, ("fcfs", "priority"))
        _choice("kv_allocator", self.kv_allocator, ("paged", "contiguous"))
        _check(isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1,
               "watermark", self.watermark, "must be in [0, 1)")
        _check(isinstance(self.generation_config, str) and self.generation_config != "",
               "generation_config", self.generation_config,
               "must be 'auto', 'vllm' or a folder holding generation_config.json")
        _check(isinstance(self.enforce_eager, bool), "enforce_eager", self.enforce_eager,
               "must be True or False")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _choice("quantization", self.quantization, QUANTIZATION_METHODS)
        _choice("quantization_group_size", self.quantization_group_size,
                (None, 32, 64, 128, 256))
        _check(isinstance(self.int8_activations, bool), "int8_activations",
               self.int8_activations, "must be True or False")
        _check(not self.int8_activations or self.quantization in ("int4", "int8", "gguf"),
               "int8_activations", self.int8_activations,
               f"needs quantization='int4', 'int8' or 'gguf' (got {self.quantization!r})")
        _check(self.quantization != "gguf" or self.quantization_group_size is None,
               "quantization_group_size", self.quantization_group_size,
               "does not apply to quantization='gguf', which takes the file's own groups "
               "(32 columns, 16 for Q6_K, Q3_K and Q2_K); leave it unset")
        _check(self.quantization_group_size is None or self.quantization == "int4",
               "quantization_group_size", self.quantization_group_size,
               f"applies to quantization='int4' only (got {self.quantization!r}; int8 has a "
               "scale per output channel, or a GGUF file's own groups); leave it unset")
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                f"quantization={self.quantization!r} with tensor_parallel_size="
                f"{self.tensor_parallel_size}: quantized layers are not split over ranks; use "
                "tensor_parallel_size=1 or quantization=None")
        self._validate_lora()

    def _validate_lora(self) -> None:
        _check(isinstance(self.enable_lora, bool), "enable_lora", self.enable_lora,
               "must be True or False")
        _int_at_least("max_loras", self.max_loras, 1)
        _int_at_least("max_lora_rank", self.max_lora_rank, 1)
        _check(self.max_lora_rank <= MAX_LORA_RANK, "max_lora_rank", self.max_lora_rank,
               f"must be <= {MAX_LORA_RANK}")
        if self.max_cpu_loras is not None:
            _int_at_least("max_cpu_loras", self.max_cpu_loras, 1)
            _check(self.max_cpu_loras >= self.max_loras, "max_cpu_loras", self.max_cpu_loras,
                   f"must be >= max_loras={self.max_loras}")
        if self.enable_lora and self.max_loras > self.max_num_seqs:
            raise ValueError(f"max_loras={self.max_loras} is invalid: must be <= "
                             f"max_num_seqs={self.max_num_seqs} (a step holds at most one "
                             "adapter per sequence)")

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @property
    def swap_space_bytes(self) -> int:
        return int(self.swap_space * _GiB)

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The per-step token budget. Without chunked prefill a whole prompt must fit in it."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        elif not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}; "
                "without chunked prefill a whole prompt must fit in one step: raise it, lower "
                "max_model_len or enable chunked prefill")
        return budget

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _check(ok: bool, name: str, value: object, limit: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {limit}")


def _int_at_least(name: str, value: object, low: int) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool) and value >= low, name, value,
           f"must be an integer >= {low}")


def _choice(name: str, value: object, choices: tuple) -> None:
    _check(value in choices, name, value, f"must be one of {', '.join(map(repr, choices))}")
