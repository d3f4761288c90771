"""Paged attention over an 8-bit KV cache (kv_quant.py) in PyTorch, with the CPU kernel's
decode fast path: the torch backend's semantics, reading quantized blocks.

One call handles a step as torch_backend.paged_attention does: quantize and store the step's
K/V (every token's, so that prefills, prefix-cache hits and decodes all read the same rounded
values: a prefix hit then gives the same result as computing the prefix), then attend. The
store is the compiled one (cpu_kernel.store_quantized, the same bytes in one pass) where the
CPU kernel runs, else kv_quant.write_to_kv_cache.

- Decodes: the compiled CPU kernel (cpu_kernel.paged_decode_attention_quantized) where it
  runs; else ``chunked_attention`` over the batch.
- Prefills: per sequence (the loop over prefills, as in the torch backend). On the CPU a
  prompt attends over its own rows as the cache now holds them (read back and dequantized
  to float32) with one causal float32 flash-attention call, and over its cached context
  (a chunk's earlier chunks, a prefix hit) ``CHUNK_BLOCKS`` blocks at a time with one call
  each, the partial results merged by their log-sum-exp (``_prefill``). Elsewhere prefills
  run ``chunked_attention``.

``chunked_attention`` walks a context ``chunk_blocks`` blocks at a time with an online
softmax (FlashAttention's running max and sum), dequantizing only the chunk it reads: the
memory it touches is bounded by the chunk, whatever the context length, and no float copy of
a whole context is ever made. Everything is computed in float32 and returned in the query's
dtype.
"""
from __future__ import annotations

import torch

from pagellm.attention import cpu_kernel
from pagellm.attention.kv_quant import QuantizedKVCache, dequantize, write_to_kv_cache
from pagellm.attention.metadata import AttentionMetadata

CHUNK_BLOCKS = 16
# torch's CPU flash attention, which returns each row's log-sum-exp (a private op: absent
# from a build, the prefills take chunked_attention)
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunked_attention(query: torch.Tensor, cache: QuantizedKVCache, block_tables: torch.Tensor,
                      query_pos: torch.Tensor, scale: float, sliding_window: int | None = None,
                      chunk_blocks: int = CHUNK_BLOCKS, zero_hidden: bool = False
                      ) -> torch.Tensor:
    """query [S, Q, H, D] at absolute positions query_pos [S, Q] of S sequences whose blocks
    are block_tables [S, num_blocks] -> [S, Q, H, D] in query's dtype.

    Key j of sequence s is visible to its query at position p iff j <= p (and j > p - window):
    a sequence's own length bounds its keys through its queries' positions, so table padding
    past it is never read unmasked. But a masked key weighs 0, and 0 x NaN is NaN: where the
    result has a NaN, it is computed again with the values of keys no row sees zeroed
    (``zero_hidden``), so that a NaN in block 0 (which the padding names) or past a sequence's
    end reaches no output (zeroing every time would cost ~15% in a batch with much padding)."""
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
        if zero_hidden:  # the values of keys no row sees (the docstring says why)
            hidden = torch.nonzero(~visible.any(2).flatten())[:, 0]  # into [S * keys]
            value.transpose(1, 2).reshape(-1, num_kv_heads * head_dim).index_fill_(0, hidden, 0)
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
    if not zero_hidden and out.isnan().any():
        return chunked_attention(query, cache, block_tables, query_pos, scale, sliding_window,
                                 chunk_blocks, zero_hidden=True)
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
            if _flash_prefill(query):
                mask = None if sliding_window is None else prefill.mask(i, sliding_window)
                table = prefill.block_tables[i, :-(-context_len // prefill.block_size)]
                out[start:end] = _prefill(query[start:end], cache, table,
                                          metadata.slot_mapping[start:end], context_len, scale,
                                          mask)
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


def _flash_prefill(query: torch.Tensor) -> bool:
    """Whether prefills attend with the CPU flash-attention op (which returns the
    log-sum-exp that merging chunks needs), rather than ``chunked_attention``."""
    return query.device.type == "cpu" and _FLASH is not None


def _prefill(query: torch.Tensor, cache: QuantizedKVCache, table: torch.Tensor,
             slots: torch.Tensor, context_len: int, scale: float,
             mask: torch.Tensor | None) -> torch.Tensor:
    """query [n, H, D] of one sequence at positions [context_len, context_len + n), whose
    own K/V were just stored at ``slots`` and whose cached context lies in the blocks
    ``table`` [ceil(context_len / block_size)] -> [n, H, D] in query's dtype.

    ``mask`` is prefill.mask's [n, context_len + n] (True = attend) under a sliding window,
    else None: plain causal. The query attends over its own rows (causal) and then over the
    context ``CHUNK_BLOCKS`` blocks at a time, each a float32 flash-attention call over rows
    dequantized from the cache; the partial results merge by their log-sum-exp, so only one
    chunk is ever dequantized. Every query sees at least its own key, so the merged
    log-sum-exp stays finite."""
    fmt = cache.format
    # [1, H, n, D], each row contiguous: the flash op reads rows as such (the query may be
    # any view, e.g. token-major columns of a product's output)
    q = query.transpose(0, 1).float().contiguous()[None]

    def attend(key_rows, value_rows, visible, causal=False):
        """key/value_rows [keys, KVH, D] float32; visible [n, keys] bool, or None: all keys
        (or causal ones) -> out [1, H, n, D], log-sum-exp [1, H, n]."""
        bias = None
        if visible is not None:
            bias = torch.zeros(visible.shape, device=query.device).masked_fill_(
                ~visible, float("-inf"))
        out, lse = _FLASH(q, key_rows.transpose(0, 1)[None], value_rows.transpose(0, 1)[None],
                          0.0, causal, attn_mask=bias, scale=scale)
        if visible is not None:  # a row with no visible key: weight 0 in the merge
            blind = ~visible.any(-1)
            out = out.masked_fill(blind[:, None], 0.0)
            lse = lse.masked_fill(blind, float("-inf"))
        return out, lse

    own_visible = None if mask is None else mask[:, context_len:]
    out, lse = attend(dequantize(cache.key.flatten(0, 1)[slots], fmt),
                      dequantize(cache.value.flatten(0, 1)[slots], fmt), own_visible,
                      causal=own_visible is None)
    block_size = cache.key.shape[1]
    chunk = CHUNK_BLOCKS * block_size
    for first in range(0, context_len, chunk):
        last = min(first + chunk, context_len)
        visible = None if mask is None else mask[:, first:last]
        if visible is not None and not visible.any():
            continue  # the whole chunk lies outside every query's window
        blocks = table[first // block_size:-(-last // block_size)]
        key = dequantize(cache.key.index_select(0, blocks), fmt).flatten(0, 1)[:last - first]
        value = dequantize(cache.value.index_select(0, blocks), fmt).flatten(0, 1)[
            :last - first]
        part, part_lse = attend(key, value, visible)
        total = torch.logaddexp(lse, part_lse)
        out = (out * torch.exp(lse - total)[..., None]
               + part * torch.exp(part_lse - total)[..., None])
        lse = total
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
