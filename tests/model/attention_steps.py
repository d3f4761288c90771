"""One attention step for the backend tests: random caches, block tables over shuffled physical
blocks, the step's q/k/v and its AttentionMetadata."""
from __future__ import annotations

import torch

from pagellm.attention import AttentionMetadata


# (tokens already in the cache, tokens computed this step), prefills first
MIXED_BATCH = [
    (0, 37),  # whole prompt: spans several 16-query blocks
    (21, 7),  # chunk continuing two earlier chunks
    (32, 9),  # prompt after a 32-token prefix-cache hit
    (0, 2),  # shortest prefill
    (24, 6),  # chunk whose first key visible under window 10 (15) ends a 16-key tile
    (0, 1),  # one-token prompt: a decode
    (24, 1),  # decode whose first key visible under window 10 (15) ends a 16-key tile
    (15, 1),  # decode whose new token ends a 16-token block
    (16, 1),  # decode at the first slot of a new block
    (70, 1),  # long decode: several key tiles
]


def make_step(batch, block_size, dtype, num_heads=6, num_kv_heads=2, head_dim=16, seed=0,
              spare_entry=False):
    """``batch``: (tokens already in the cache, tokens computed this step) per sequence,
    prefills first. ``spare_entry`` gives every block table one entry past what its sequence
    needs (tables may be longer than the context). Returns q, k, v, k_cache, v_cache,
    metadata, tables, seq_lens."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in batch]
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 5
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start:start + n] + ([ids[-1]] if spare_entry else []))
        start += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(q for _, q in batch)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    metadata = AttentionMetadata.build([q for _, q in batch], seq_lens, tables, block_size)
    return q, k, v, k_cache, v_cache, metadata, tables, seq_lens


def store_rows(fmt, dtype):
    """K/V rows [9, 3, 64] in ``dtype`` for an 8-bit store to write into caches of 40 slots,
    and their slots (one -1, padding): rows over ten decades of magnitude, zero rows and
    entries, -0.0, rows with a NaN, an infinity, a -infinity, and rows whose largest entry is qmax (scale 1) holding every tie between
    two neighbouring codes of ``fmt`` (round to nearest even); the random rows include ones
    whose rounded bfloat16 scale puts their largest entry past qmax (clamped)."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 9, 3, 64
    magnitude = 10 ** torch.empty(tokens, heads, 1).uniform_(-6, 4, generator=gen)
    key = torch.randn(tokens, heads, head_dim, generator=gen) * magnitude
    value = torch.randn(tokens, heads, head_dim, generator=gen) * magnitude
    key[0, 0], value[1, 1, :5], key[2, 1, 3] = 0, 0, -0.0
    value[3, 0, 7], key[5, 1, 10], key[6, 0, 0] = float("nan"), float("-inf"), float("inf")
    codes = torch.arange(256, dtype=torch.uint8).view(fmt.storage).float()
    codes = codes[codes.isfinite() & (codes.abs() <= fmt.qmax)].unique()  # sorted
    ties = ((codes[1:] + codes[:-1]) / 2)
    ties = ties[(ties.to(dtype).float() == ties)]  # representable in the rows' dtype
    for row, start in enumerate(range(0, len(ties), head_dim - 2)):
        if row >= tokens:
            break
        chunk = ties[start:start + head_dim - 2]
        key[row, 2] = 0
        key[row, 2, :len(chunk)] = chunk
        key[row, 2, -2:] = torch.tensor([fmt.qmax, -fmt.qmax])  # amax qmax: scale 1
        value[row, 2] = key[row, 2] * 2  # scale 2: the same ties after the division
    slots = torch.randperm(40, generator=gen)[:tokens]
    slots[4] = -1
    return key.to(dtype), value.to(dtype), slots
