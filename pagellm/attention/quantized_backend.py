"""Paged attention over an 8-bit KV cache (kv_quant.py) in PyTorch, with the CPU kernel's
decode fast path: the torch backend's semantics, reading quantized blocks.

One call handles a step as torch_backend.paged_attention does: quantize and store the step's
K/V (every token's, so that prefills, prefix-cache hits and decodes all read the same rounded
values: a prefix hit then gives the same result as computing the prefix), then attend. The
store is the compiled one (cpu_kernel.store_quantized, the same bytes in one pass) where the
CPU kernel runs, else kv_quant.write_to_kv_cache.

- Decodes: the compiled CPU kernel (cpu_kernel.paged_decode_attention_quantized) where it
  runs; else ``chunked_attention`` over the batch.
- Prefills: per sequence (the loop over prefills, as in the torch backend). A prompt with
  nothing cached attends over its own rows as the cache now holds them (read back and
  dequantized to float32) with one float32 ``scaled_dot_product_attention``, causal, as the
  torch backend's fresh prompts do; a chunk or a prompt after a prefix hit, whose context
  lies in earlier blocks, runs ``chunked_attention``.

``chunked_attention`` walks a context ``chunk_blocks`` blocks at a time with an online
softmax (FlashAttention's running max and sum), dequantizing only the chunk it reads: the
memory it touches is bounded by the chunk, whatever the context length, and no float copy of
a whole context is ever made. Everything is computed in float32 and returned in the query's
dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagellm.attention import cpu_kernel
from pagellm.attention.kv_quant import QuantizedKVCache, dequantize, write_to_kv_cache
from pagellm.attention.metadata import AttentionMetadata

CHUNK_BLOCKS = 16


def chunked_attention(query: torch.Tensor, cache: QuantizedKVCache, block_tables: torch.Tensor,
                      query_pos: torch.Tensor, scale: float, sliding_window: int | None = None,
                      chunk_blocks: int = CHUNK_BLOCKS) -> torch.Tensor:
    """query [S, Q, H, D] at absolute positions query_pos [S, Q] of S sequences whose blocks
    are block_tables [S, num_blocks] -> [S, Q, H, D] in query's dtype.

    Key j of sequence s is visible to its query at position p iff j <= p (and j > p - window):
    a sequence's own length bounds its keys through its queries' positions, so table padding
    past it is never read unmasked."""
    num_seqs, num_queries, num_heads, head_dim = query.shape
    block_size, num_kv_heads = cache.key.shape[1], cache.key.shape[2]
    group = num_heads // num_kv_heads
    rows = group * num_queries  # per KV head: row g * Q + i is query i of head g of the group
    q = (query.float().view(num_seqs, num_queries, num_kv_heads, group, head_dim)
         .permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, rows, head_dim))
    row_pos = query_pos.repeat(1, group)[:, None, :, None]  # [S, 1, rows, 1]
    running_max = torch.full((num_seqs, num_kv_heads, rows), float("-inf"), device=query.device)
    running_sum = torch.zeros(num_seqs, num_kv_heads, rows, device=query.device)
    acc = torch.zeros(num_seqs, num_kv_heads, rows, head_dim, device=query.device)
    for first in range(0, block_tables.shape[1], chunk_blocks):
        table = block_tables[:, first:first + chunk_blocks]  # [S, n]
        key = _chunk(cache.key, table, cache)  # [S, KVH, n * block_size, D] float32
        value = _chunk(cache.value, table, cache)
        key_pos = first * block_size + torch.arange(key.shape[2], device=query.device)
        visible = key_pos <= row_pos  # [S, 1, rows, keys]
        if sliding_window is not None:
            visible &= key_pos > row_pos - sliding_window
        scores = (q @ key.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(-1))
        # a row with no visible key yet keeps max -inf: subtract 0, not -inf (no NaN)
        safe_max = torch.where(new_max == float("-inf"), 0.0, new_max)
        weights = torch.exp(scores - safe_max[..., None])
        rescale = torch.exp(running_max - safe_max)
        running_sum = running_sum * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + weights @ value
        running_max = new_max
    out = acc / running_sum[..., None]  # [S, KVH, G * Q, D]
    out = out.view(num_seqs, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs, num_queries, num_heads, head_dim).to(query.dtype)


def _chunk(raw: torch.Tensor, table: torch.Tensor, cache: QuantizedKVCache) -> torch.Tensor:
    """Blocks ``table`` [S, n] of one cache, dequantized: [S, KVH, n * block_size, D]."""
    num_seqs, n = table.shape
    blocks = raw.index_select(0, table.flatten())  # [S * n, block_size, KVH, D + 2] uint8
    rows = dequantize(blocks, cache.format)  # [S * n, block_size, KVH, D]
    return rows.view(num_seqs, n * raw.shape[1], *rows.shape[2:]).transpose(1, 2)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    cache: QuantizedKVCache, metadata: AttentionMetadata, scale: float,
                    sliding_window: int | None = None) -> torch.Tensor:
    """One attention layer for a step over an 8-bit cache.

    query [num_tokens, num_heads, D]; key, value [num_tokens, num_kv_heads, D] of the step's
    tokens (quantized into the cache here); returns [num_tokens, num_heads, D]."""
    if cpu_kernel.supports_quantized(key, cache):
        cpu_kernel.store_quantized(key, value, cache, metadata.slot_mapping)
    else:
        write_to_kv_cache(key, value, cache, metadata.slot_mapping, metadata.write_index)
    out = torch.empty_like(query)
    num_prefill_tokens = metadata.num_prefill_tokens
    if metadata.prefill is not None:
        prefill, start = metadata.prefill, 0
        for i, (query_len, context_len) in enumerate(zip(prefill.query_lens,
                                                         prefill.context_lens)):
            end, seq_len = start + query_len, context_len + query_len
            if context_len == 0:
                out[start:end] = _fresh_prompt(query[start:end], cache,
                                               metadata.slot_mapping[start:end], scale,
                                               prefill.mask(i, sliding_window))
            else:
                table = prefill.block_tables[i:i + 1, :-(-seq_len // prefill.block_size)]
                positions = torch.arange(context_len, seq_len, device=query.device)[None]
                out[start:end] = chunked_attention(query[None, start:end], cache, table,
                                                   positions, scale, sliding_window)[0]
            start = end
    if metadata.decode is not None:
        out[num_prefill_tokens:] = decode_attention(query[num_prefill_tokens:], cache,
                                                    metadata, scale, sliding_window)
    return out


def _fresh_prompt(query: torch.Tensor, cache: QuantizedKVCache, slots: torch.Tensor,
                  scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """query [n, H, D] of a prompt with nothing cached, whose K/V were just stored at
    ``slots``: attention over those rows as the cache holds them, in float32 (one
    scaled_dot_product_attention; ``mask`` None: causal) -> [n, H, D] in query's dtype."""
    key = dequantize(cache.key.flatten(0, 1)[slots], cache.format)  # [n, KVH, D] float32
    value = dequantize(cache.value.flatten(0, 1)[slots], cache.format)
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1)[None], key.transpose(0, 1)[None],
        value.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=True)  # [1, H, n, D]
    return out[0].transpose(0, 1).to(query.dtype)


def decode_attention(query: torch.Tensor, cache: QuantizedKVCache, metadata: AttentionMetadata,
                     scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """query [num_decodes, num_heads, D], one token per sequence (already stored)."""
    decode = metadata.decode
    if cpu_kernel.supports_quantized(query, cache):
        return cpu_kernel.paged_decode_attention_quantized(
            query, cache, decode.block_pairs(), decode.seq_lens, decode.max_seq_len, scale,
            sliding_window)
    positions = (decode.seq_lens - 1)[:, None]  # [num_decodes, 1]
    return chunked_attention(query[:, None], cache, decode.block_tables, positions, scale,
                             sliding_window)[:, 0]
