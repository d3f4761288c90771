"""Paged attention in plain PyTorch: the CPU path, and the reference the other kernels meet.

Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; the K/V of token
``i`` of the step go to ``slot_mapping[i] = block * block_size + offset``.

One call handles a whole step: write the step's K/V into their slots (one ``index_copy_``), then
attend each query over its sequence's context read back through the block table, which covers
tokens of earlier steps (earlier prompt chunks, prefix-cache hits) and of this one alike. Reading
the step's own K/V back from the cache rather than from the projections keeps one code path for
whole prompts, continued chunks and cached prefixes.

- Prefills (query_len > 1) are gathered into a padded [num_prefills, max_query_len] grid and
  run through ``scaled_dot_product_attention`` with a causal mask over absolute positions.
- Decodes take a fast path. On the CPU, for float32 and bfloat16, a compiled kernel
  (attention/cpu_kernel.py) reads K/V in place; otherwise ``decode_attention`` gathers the
  context and treats the query heads sharing a KV head (grouped-query attention) as a short
  query "sequence" for that head, so no K/V is repeated per query head.

No Python loop runs over tokens or sequences; every op is batched over the whole group.
Gathered contexts land in grow-only scratch buffers reused by every layer and step: a fresh
multi-megabyte tensor per layer costs page faults that measured slower than the copy itself.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagellm.attention import cpu_kernel
from pagellm.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata

_scratch: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A reusable tensor of ``shape`` (uninitialised). Valid until the next call with ``name``;
    the engine runs one step at a time. Buffers made under inference mode are kept apart: such
    a tensor cannot be written in place outside it."""
    numel = math.prod(shape)
    key = (name, dtype, device, torch.is_inference_mode_enabled())
    buffer = _scratch.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = torch.empty(int(numel * 1.25) + 1024, dtype=dtype, device=device)
        _scratch[key] = buffer
    return buffer[:numel].view(shape)


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at ``metadata.slot_mapping``."""
    slots = metadata.slot_mapping
    if metadata.write_index is not None:  # padding tokens (slot -1) are not written
        key, value = key[metadata.write_index], value[metadata.write_index]
        slots = slots[metadata.write_index]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor,
                  name: str) -> torch.Tensor:
    """The context of each sequence: [num_seqs, num_kv_heads, max_num_blocks * block_size, D].

    A strided view over one contiguous gather (index_select copies whole blocks) into the
    scratch buffer ``name``; attention kernels accept the head stride, so no transposed copy
    is made.
    """
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    gathered = scratch(name, (num_seqs * max_blocks, block_size, num_kv_heads, head_dim),
                       cache.dtype, cache.device)
    torch.index_select(cache, 0, block_tables.flatten(), out=gathered)
    return gathered.view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, prefill: PrefillMetadata,
                      scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """query [num_prefill_tokens, num_heads, D]; key, value [num_prefill_tokens, KVH, D] of
    the step (already in the cache) -> output [num_prefill_tokens, num_heads, D]."""
    num_tokens, num_heads, head_dim = query.shape
    if prefill.only_new_tokens and (sliding_window is None or sliding_window >= num_tokens):
        # A whole prompt alone: its keys are the step's own, so plain causal attention (the
        # kernel transformers uses too) needs neither a gather nor a mask.
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None],
                                             key.transpose(0, 1)[None],
                                             value.transpose(0, 1)[None], is_causal=True,
                                             scale=scale, enable_gqa=True)  # [1, H, T, D]
        return out[0].transpose(0, 1)
    num_prefills, max_query_len = prefill.query_positions.shape
    padded = query.new_zeros(num_prefills * max_query_len, num_heads, head_dim)
    padded.index_copy_(0, prefill.padded_index, query)
    padded = padded.view(num_prefills, max_query_len, num_heads, head_dim).transpose(1, 2)
    key = gather_blocks(k_cache, prefill.block_tables, "prefill_key")  # [P, KVH, keys, D]
    value = gather_blocks(v_cache, prefill.block_tables, "prefill_value")
    out = F.scaled_dot_product_attention(padded, key, value, attn_mask=prefill.mask(sliding_window),
                                         scale=scale, enable_gqa=True)  # [P, H, max_q, D]
    out = out.transpose(1, 2).reshape(num_prefills * max_query_len, num_heads, head_dim)
    return out.index_select(0, prefill.padded_index)


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     decode: DecodeMetadata, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """query [num_decodes, num_heads, D] (one token per sequence) -> output of the same shape.

    The pure-torch decode path (what runs where the compiled kernel does not)."""
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    # The query heads sharing a KV head (grouped-query attention) form a short "sequence".
    grouped = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    key = gather_blocks(k_cache, decode.block_tables, "decode_key")  # [S, KVH, keys, D]
    value = gather_blocks(v_cache, decode.block_tables, "decode_value")
    out = F.scaled_dot_product_attention(grouped, key, value,
                                         attn_mask=decode.mask(sliding_window), scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One attention layer for a step.

    query [num_tokens, num_heads, D]; key, value [num_tokens, num_kv_heads, D] of the step's
    tokens (written to the cache here); returns [num_tokens, num_heads, D].
    """
    write_to_kv_cache(key, value, k_cache, v_cache, metadata)
    num_prefill_tokens = metadata.num_prefill_tokens
    if metadata.decode is None:
        return prefill_attention(query, key, value, k_cache, v_cache, metadata.prefill, scale,
                                 sliding_window)
    if metadata.prefill is None:
        return _decode(query, k_cache, v_cache, metadata.decode, scale, sliding_window)
    out = torch.empty_like(query)
    out[:num_prefill_tokens] = prefill_attention(
        query[:num_prefill_tokens], key[:num_prefill_tokens], value[:num_prefill_tokens],
        k_cache, v_cache, metadata.prefill, scale, sliding_window)
    out[num_prefill_tokens:] = _decode(query[num_prefill_tokens:], k_cache, v_cache,
                                       metadata.decode, scale, sliding_window)
    return out


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            decode: DecodeMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    if cpu_kernel.supports(query):
        return cpu_kernel.paged_decode_attention(query, k_cache, v_cache, decode.block_pairs(),
                                                 decode.seq_lens, decode.max_seq_len, scale,
                                                 sliding_window)
    return decode_attention(query, k_cache, v_cache, decode, scale, sliding_window)


def reference_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              query_lens: list[int], seq_lens: list[int],
                              block_tables: list[list[int]], scale: float,
                              sliding_window: int | None = None) -> torch.Tensor:
    """The definition, one sequence at a time, in float64: for a query at position p,
    softmax(q . k_j * scale) over the sequence's keys j <= p (and j > p - window), times v_j.

    Reads the cache slot by slot through the block table; the K/V of the step must already be
    in the cache. query [num_tokens, num_heads, D] packed in sequence order.
    """
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    outputs, start = [], 0
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        slots = torch.tensor([table[j // block_size] * block_size + j % block_size
                              for j in range(seq_len)])
        key = k_cache.flatten(0, 1)[slots].double()  # [seq_len, KVH, D]
        value = v_cache.flatten(0, 1)[slots].double()
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)  # [seq_len, H, D]
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:start + query_len].double()  # [query_len, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, key) * scale
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value))
        start += query_len
    return torch.cat(outputs).to(query.dtype)
