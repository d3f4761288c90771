"""The decoder shared by the Llama-style families (Llama 2/3, Mistral, Qwen2, Qwen3).

They differ only in a few switches (biases, per-head q/k RMSNorm, sliding window), collected in
DecoderSpec; the module tree and parameter names mirror transformers' (``model.layers.N.
self_attn...``) so checkpoints load by name, except that q/k/v and gate/up are fused
(see ``packed_modules_mapping``).

Forward works on a flat batch of tokens [num_tokens, ...] from many sequences at once; which
sequence a token belongs to only matters inside attention, through the AttentionMetadata.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention import Attention, AttentionMetadata, KVCache
from pagellm.model.layers import (MergedLinear, ParallelLMHead, QKVLinear, RMSNorm,
                                  RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding,
                                  cpu_ops, pack_linear_weights)


@dataclass(slots=True, frozen=True)
class DecoderSpec:
    """What distinguishes one family's decoder from another's."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The layer's sliding window, read the way transformers reads it for these families."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window


class DecoderAttention(nn.Module):
    """Under tensor parallelism: this rank's heads (qkv_proj column-parallel, o_proj
    row-parallel), so the head counts here are the rank's."""

    def __init__(self, config: Any, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                  config.num_key_value_heads, bias=spec.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=spec.o_proj_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              scale=self.head_dim ** -0.5,
                              sliding_window=sliding_window_of(config, layer_idx))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]  # hidden: [T, hidden_size]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, -1, self.head_dim)  # [T, H + KVH, D], a view
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # views of qk
        if not self.qk_norm and RotaryEmbedding.rotates_in_place(qk):
            RotaryEmbedding.apply_(qk, cos, sin)  # q and k at once, in place
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = self.attn(q, k, v, kv_cache, metadata)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(self, config: Any, spec: DecoderSpec) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate_size]
        if (gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2 and gate_up.stride(1) == 1
                and cpu_ops.available(gate_up, "silu_and_mul")):
            return self.down_proj(cpu_ops.silu_and_mul(gate_up))  # one pass, the same bits
        gate, up = gate_up.chunk(2, dim=-1)  # each [T, intermediate_size]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)), then h + mlp(norm(h)), with transformers' roundings.

    The residual stream travels beside the layer output, as in vLLM: each layer returns
    (mlp output, stream) and the next layer's first norm adds the two, fused with the norm
    (RMSNorm(x, residual)), so the additions are those of transformers, in its order.
    """

    def __init__(self, config: Any, spec: DecoderSpec, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, spec, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DecoderMLP(config, spec)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's mlp output, or the embeddings with residual None."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden_size]
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # each [T, 1, head_dim]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, metadata)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class CausalLM(nn.Module):
    """Base of every family: decoder + lm_head (tied to the embedding when the config says so).

    ``forward`` returns final hidden states for all tokens; ``compute_logits`` is applied by the
    runner only to the rows that need logits, because the vocabulary projection is the largest
    matmul of a prefill step.
    """

    # checkpoint name -> (fused parameter name, shard id) for the fused projections
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.decoder_spec(config))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, metadata)

    def pack_weights(self) -> int:
        """After loading, on the CPU: every projection in oneDNN's layout (Linear.pack). A tied
        lm_head keeps the plain weight, which the embedding reads."""
        shared = {id(self.lm_head.weight)} if self.tie_word_embeddings else set()
        return pack_linear_weights(self, shared)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden_size] -> logits [R, vocab_size] in the model dtype (under tensor
        parallelism on rank 0; the other ranks get [R, 0])."""
        return self.lm_head(hidden)
