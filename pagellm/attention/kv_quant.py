"""8-bit KV cache: the formats, the layout, quantize on store, dequantize on read.

``kv_cache_dtype`` (as in vLLM): ``auto`` keeps the model dtype; ``int8``, ``fp8`` (=
``fp8_e4m3``) and ``fp8_e5m2`` store one byte per element.

Scale scheme: one scale per (token, KV head) for every 8-bit format, stored as bfloat16 right
after the head's ``head_dim`` bytes: a cache row is ``[head_dim bytes | 2-byte scale]``, so a
block is ``[block_size, num_kv_heads, head_dim + 2]`` bytes and the scales live *inside* the
blocks. Why:

- per token and head, because the store quantizes each new token as it arrives, with no
  calibration pass: the scale is ``amax(|row|) / qmax`` of that row alone, so a new token never
  rescales old ones (a per-block scale would, or would clip), and an outlier head of one token
  costs precision to that row only;
- the same scheme for fp8: float8 has an exponent, but e4m3 saturates at 448 and a fixed
  per-tensor scale (vLLM's default 1.0 without calibrated scales) either clips outliers or
  wastes the small values' precision; a row scale maps every row onto the format's full range;
- bfloat16 scales: 2 bytes per 64-dim head row (3%) keep the bytes per token at 66/128 of
  bfloat16's (1.94x the tokens per byte budget); float32 scales would give 1.88x. The
  dequantized value ``q * scale`` of an 8-bit q and a bfloat16 scale is exact in float32;
- inside the blocks, because then everything that moves blocks (copy-on-write, swap out/in,
  the CPU swap pool, prefix sharing) moves the scales with them, with no code of its own, and a
  row's scale sits in the cache line its values come from.

Readers dequantize a block (or a tile of keys) at a time inside the attention loop (the torch
path in chunks, the C kernel and the Triton kernels per key row), never a bfloat16 copy of a
whole context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagellm.config import KV_CACHE_DTYPES

SCALE_BYTES = 2  # one bfloat16 scale per (token, KV head) row


@dataclass(frozen=True, slots=True)
class KVFormat:
    """An 8-bit KV cache format: ``storage`` is the torch dtype of the values, ``qmax`` the
    largest magnitude a row is scaled to."""

    name: str
    storage: torch.dtype
    qmax: float

    def lut(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[256] float32: the value of each byte (read as this format), for kernels that
        decode by table (the C kernel's fp8 loops, the Triton kernels)."""
        return torch.arange(256, dtype=torch.uint8, device=device).view(self.storage).float()


FORMATS: dict[str, KVFormat] = {
    "int8": KVFormat("int8", torch.int8, 127.0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
_ALIASES = {"fp8": "fp8_e4m3"}


def kv_format(kv_cache_dtype: str) -> KVFormat | None:
    """The 8-bit format of ``kv_cache_dtype``; None for ``auto`` (the model dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported; supported: "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    if kv_cache_dtype == "auto":
        return None
    return FORMATS[_ALIASES.get(kv_cache_dtype, kv_cache_dtype)]


class QuantizedKVCache(NamedTuple):
    """One layer's 8-bit K and V caches: raw bytes ``[num_blocks, block_size, num_kv_heads,
    head_dim + SCALE_BYTES]`` uint8 (values, then the row's bfloat16 scale), and the format."""

    key: torch.Tensor
    value: torch.Tensor
    format: KVFormat

    @property
    def head_dim(self) -> int:
        return self.key.shape[-1] - SCALE_BYTES


def values(raw: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The 8-bit values of raw rows ``[..., head_dim + 2]`` as ``fmt.storage`` [..., head_dim]
    (a strided view, no copy)."""
    return raw[..., :-SCALE_BYTES].view(fmt.storage)


def scales(raw: torch.Tensor) -> torch.Tensor:
    """The bfloat16 scales of raw rows ``[..., head_dim + 2]`` -> [...] (a strided view)."""
    return raw[..., -SCALE_BYTES:].view(torch.bfloat16)[..., 0]


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Rows ``x [..., head_dim]`` -> raw rows ``[..., head_dim + 2]`` uint8.

    scale = bfloat16(amax / qmax) (1 for an all-zero row); q = x / scale rounded to the format
    (int8: to nearest, clamped to +-127; fp8: clamped to +-qmax, then torch's round to nearest
    even), so that q * scale is the dequantized value. A row with a NaN or an infinity gets
    scale NaN and codes 0, so that it reads back all NaN (not as codes of some other scale)."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)  # [..., 1] (NaN where the row has one)
    finite = amax.isfinite()
    scale = torch.where(amax > 0, amax / fmt.qmax, 1.0).to(torch.bfloat16)
    # the bits of a quiet NaN (0x7FC0) as the C and Triton stores write them
    scale = torch.where(finite, scale.view(torch.int16), 0x7FC0).view(torch.bfloat16)
    scaled = torch.where(finite, (x / scale.float()).clamp(-fmt.qmax, fmt.qmax), 0.0)
    q = scaled.round().to(torch.int8) if fmt.storage == torch.int8 else scaled.to(fmt.storage)
    raw = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.uint8,
                      device=x.device)
    raw[..., :-SCALE_BYTES] = q.view(torch.uint8)
    raw[..., -SCALE_BYTES:] = scale.view(torch.uint8)
    return raw


def decode_values(raw: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """The 8-bit values of raw rows ``[..., head_dim + 2]`` as float32 ``[..., head_dim]``:
    the values of ``values(raw, fmt).float()`` bit for bit (NaN codes, signed zeros
    included), through float16 for the fp8 formats, whose conversions torch runs a value at
    a time on the CPU (e4m3 5x, e5m2 2x slower than these): e5m2 is the high byte of a
    float16; e4m3's sign, exponent and mantissa moved into float16's places read as the
    value times 2^-8, its NaN codes (exponent and mantissa all ones) given float16's
    exponent 31."""
    codes = raw[..., :-SCALE_BYTES]
    if fmt.storage == torch.float8_e5m2:
        return (codes.to(torch.int16) << 8).view(torch.float16).float()
    if fmt.storage == torch.float8_e4m3fn:
        bits = (codes.view(torch.int8).to(torch.int16) << 7) & -0x4080  # mask 0xBF80
        bits |= ((bits & 0x3F80) + 0x80) & 0x4000
        return bits.view(torch.float16).float().mul_(256.0)
    return codes.view(fmt.storage).float()


def dequantize(raw: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Raw rows ``[..., head_dim + 2]`` -> ``[..., head_dim]`` in ``dtype`` (q * scale)."""
    return (decode_values(raw, fmt) * scales(raw).float()[..., None]).to(dtype)


def fake_quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x`` rounded through the format and back, in x's dtype: what a reader of the 8-bit
    cache sees for these rows."""
    return dequantize(quantize(x, fmt), fmt, x.dtype)


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, cache: QuantizedKVCache,
                      slot_mapping: torch.Tensor, write_index: torch.Tensor | None) -> None:
    """Quantize key/value [num_tokens, num_kv_heads, head_dim] and store them at
    ``slot_mapping`` (tokens outside ``write_index`` are padding, not written)."""
    slots = slot_mapping
    if write_index is not None:
        key, value, slots = key[write_index], value[write_index], slots[write_index]
    for rows, raw in ((key, cache.key), (value, cache.value)):
        raw.flatten(0, 1).index_copy_(0, slots, quantize(rows, cache.format))


def dequantized_cache(cache: QuantizedKVCache,
                      dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole cache dequantized, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each:
    for tests and references only (the attention paths never build it)."""
    return dequantize(cache.key, cache.format, dtype), dequantize(cache.value, cache.format, dtype)
