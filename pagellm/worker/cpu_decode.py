"""Decode steps on the CPU with the layers' kernels called in a row, without their Python.

A decode step of a small model spends more time in the Python around its kernels than in
most of them: SmolLM2-135M with int4 weights, one thread, on an AVX2 EPYC, ~8.7 ms of a 21 ms
step went to ~290 us per decoder layer outside the matmuls (docs/BENCHMARKS.md). For a
decode-only step of a model it supports (``CpuDecodePlan.supports``), the plan makes the same
kernel calls the layers' forward makes, in the same order and on the same values, with their
arguments prepared once per number of sequences and buffers allocated once, each run of
consecutive compiled calls made by one C loop (``native.chain_calls``; at batch 1 on an AMX
Xeon about 10% less time per token with two threads and 6% with one than a ctypes call each,
docs/BENCHMARKS.md):

    rms_norm (+ residual) -> qkv product -> rotary in place on q and k (Qwen3: after its
    per-head q/k norms, through the norm modules as the forward does) -> decode attention
    (storing the step's K/V; an 8-bit cache: the compiled quantizing store first, as the
    layer's quantized path) -> o product -> rms_norm (+ residual) -> gate_up product ->
    SiLU-and-multiply (float32: torch's, as the MLP computes it) -> down product, per layer;
    then the final rms_norm.

A projection on pagellm's compiled products (int4/int8, the bfloat16 kernel) is a prepared
call too, for fewer than ``quant_matmul.GEMM_ROWS`` sequences, and at any number where the
AVX512-BF16 products take the rows (from ``quant_matmul.LOOP_DOT_ROWS`` bfloat16 rows, and
``DOT_ROWS`` on torch's kernels' layers), in the plan's workspace; an int4/int8 layer on torch's
kernels (AVX-512 CPUs) is that kernel's call with its arguments bound
(``Int4Weight.torch_product``), its result copied into the plan's buffer; anything else (from
GEMM_ROWS rows on the float32 GEMM, oneDNN's packed bfloat16 weights, a bias the bfloat16
kernel sums) runs the layer's own forward, its result copied likewise. Between the kernels
only the step's fields are set (the attention's block pairs, lengths, slots and workspace;
rotary's cos and sin), so its hidden states equal the eager forward's bit for bit
(tests/engine/test_cpu_decode.py). The embedding lookup, the rotary angles and the vocabulary
projection stay with the model. Anything else (prefill, more sequences than ``max_rows`` =
max_num_seqs, a model or configuration it does not support) runs the eager forward: ``run``
returns None. ``enforce_eager=True`` turns it off, as it turns off CUDA graphs on the GPU.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagellm import native
from pagellm.attention import Attention, AttentionMetadata, cpu_kernel
from pagellm.attention.kv_quant import QuantizedKVCache
from pagellm.attention.layer import select_backend
from pagellm.attention.torch_backend import paged_attention
from pagellm.model.decoder import CausalLM, DecoderAttention, DecoderLayer
from pagellm.model.layers import Linear, RotaryEmbedding, cpu_ops, quant_matmul
from pagellm.native import PreparedCall


def _projections(layer: DecoderLayer) -> tuple:
    """A decoder layer's four projections, in the order a step runs them."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _matmul_of(linear: Linear, rows: int, dtype: torch.dtype
               ) -> quant_matmul.QuantizedMatmul | None:
    """The compiled product a decode step's Linear runs on ``rows`` rows of ``dtype``
    (weight-only quantized: compiled, or torch's kernels' layers where the AVX512-BF16
    product takes their rows; the bfloat16 kernel), if it runs one."""
    quantized = linear.quantized  # Int4Weight or Int8Weight
    if quantized is not None:
        return quantized.kernel if quantized.compiled or quantized.runs_dot(rows, dtype) else None
    if linear.packed_weight is None and linear.upcast and linear.bf16_kernel is not None:
        return linear.bf16_kernel
    return None


def _projection(linear: Linear, x: torch.Tensor, out: torch.Tensor,
                workspace: torch.Tensor) -> list[Callable[[], object]]:
    """The calls that write linear(x) into ``out``, as the layer's forward computes it.

    A compiled product of fewer than GEMM_ROWS rows, or of any number the AVX512-BF16
    product runs, is a prepared call, and torch's int4/int8 kernel (the layer's
    torch_product) a bound call copied into ``out``, each with its bias (quantized layers:
    ``out + bias``) added in place; any other projection (from GEMM_ROWS rows on, the float32
    GEMM; oneDNN's packed weights, the bfloat16 kernel with its bias in the sums) runs the
    layer's forward on the same values, its result copied into ``out``."""
    rows = x.shape[0]
    matmul = _matmul_of(linear, rows, x.dtype)
    calls: list[Callable[[], object]] | None = None
    if (matmul is not None
            and (rows < quant_matmul.GEMM_ROWS or matmul.runs_dot(rows, x.dtype))
            and (linear.bias is None or linear.quantized is not None)):
        calls = [matmul.prepared(x, out, workspace)]
    elif linear.quantized is not None:
        product = linear.quantized.torch_product(x)
        if product is not None:  # torch's int4/int8 kernel, called without the layers
            calls = [lambda: out.copy_(product())]
    if calls is not None:
        if linear.bias is not None:  # Linear.forward's out + bias, in place
            calls.append(lambda bias=linear.bias: out.add_(bias))
        return calls
    forward = linear.forward
    return [lambda: out.copy_(forward(x))]


class CpuDecodePlan:
    """The decode-step kernel calls of one model over its KV caches (see the module)."""

    def __init__(self, model: CausalLM, kv_caches: list, max_rows: int) -> None:
        decoder = model.model
        self.model, self.kv_caches = model, kv_caches
        self._attention_layers = [layer.self_attn.attn for layer in decoder.layers]
        first = decoder.layers[0]
        self.dtype = decoder.norm.weight.dtype
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = (attn.num_heads, attn.num_kv_heads,
                                                            attn.head_dim)
        hidden = model.config.hidden_size
        inter = first.mlp.down_proj.in_features
        qkv_width = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.max_rows = rows = max_rows

        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(rows, width, dtype=self.dtype)

        self.residual, self.normed, self.qkv = buffer(hidden), buffer(hidden), buffer(qkv_width)
        self.query = buffer(self.num_heads * self.head_dim)
        self.attn_out = buffer(self.num_heads * self.head_dim)
        self.o_out, self.gate_up = buffer(hidden), buffer(2 * inter)
        self.act, self.down, self.final = buffer(inter), buffer(hidden), buffer(hidden)
        self.cos = torch.zeros(rows, self.head_dim, dtype=self.dtype)
        self.sin = torch.zeros(rows, self.head_dim, dtype=self.dtype)
        widest = max(hidden, inter)
        # the prepared products' (fewer than GEMM_ROWS rows; the forward's GEMM from there;
        # the AVX512-BF16 products' is sized per thread count, at the first step of each)
        kernel_rows = min(rows, quant_matmul.GEMM_ROWS - 1)
        self.workspace = torch.zeros(quant_matmul.workspace_floats(kernel_rows, widest) + 64)
        self.threads = 0
        self.norm_scratch = torch.zeros(0)
        # whether the steps chain their compiled calls (native.chain_calls; off only to
        # measure what that gains, benchmarks/cpu_decode_plan.py --unchained: those plans
        # are kept apart, in _unchained)
        self.chain = True
        # rows -> (the step's calls, its attention calls with an 8-bit cache's store or None)
        self._plans: dict[int, tuple[list[Callable[[], object]],
                                     list[tuple[PreparedCall, PreparedCall | None]]]] = {}
        self._unchained: dict = {}

    @staticmethod
    def supports(model: CausalLM, kv_caches: list) -> str | None:
        """None when the plan can run this model's decode steps, else why not."""
        decoder = getattr(model, "model", None)
        layers = getattr(decoder, "layers", None)
        if layers is None or not len(layers):
            return "not a decoder model"
        dtype = decoder.norm.weight.dtype
        if (dtype not in (torch.bfloat16, torch.float32)
                or decoder.norm.weight.device.type != "cpu"):
            return "the plan runs bfloat16 and float32 models on the CPU"
        for layer, cache in zip(layers, kv_caches, strict=True):
            if type(layer) is not DecoderLayer or type(layer.self_attn) is not DecoderAttention:
                return "a layer the plan does not know"
            if isinstance(cache, QuantizedKVCache):
                if cache.head_dim > 256:
                    return "an 8-bit KV cache of head_dim > 256 (the kernel's limit)"
            elif not isinstance(cache, tuple) or cache[0].dtype != dtype:
                return "the plan reads a KV cache of the model dtype, or an 8-bit one"
            if (type(layer.self_attn.attn) is not Attention
                    or layer.self_attn.attn.reference_kv_format is not None):
                return "a replaced attention layer"
            for linear in _projections(layer):
                if not isinstance(linear, Linear):
                    return "a replaced projection (LoRA)"
                if getattr(linear, "tp", None) is not None and linear.tp.world_size > 1:
                    return "tensor parallelism (projections split across ranks)"
        probe = torch.empty(1, 1, dtype=dtype)
        for op in ("rms_norm", "rotary"):  # SiLU-and-multiply: compiled or torch's, as the MLP
            if not cpu_ops.available(probe, op):
                return f"the compiled {op} is off (it differs from torch's on this CPU)"
        if not cpu_kernel.available():
            return "the compiled attention kernel is off"
        return None

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [rows, hidden] of a decode-only step of at most max_rows sequences,
        or None (the caller runs the model). The tensor is the plan's buffer: read it before
        the next step."""
        rows = input_ids.shape[0]
        if (metadata.prefill is not None or metadata.decode is None
                or not 0 < rows <= self.max_rows
                or select_backend(self.residual) is not paged_attention
                or any(a.reference_kv_format is not None for a in self._attention_layers)):
            return None
        if torch.get_num_threads() != self.threads:  # kernels and scratch are per thread count
            self.threads = torch.get_num_threads()
            self.norm_scratch = torch.zeros(2 * self.residual.shape[1] * self.threads + 64)
            self._plans.clear()
            self._unchained.clear()
            dot = self._dot_workspace_floats()
            if dot > self.workspace.numel():  # no plan holds the old one any more
                self.workspace = torch.zeros(dot)
        decoder = self.model.model
        cos, sin = decoder.rotary_emb(metadata.positions, self.dtype)  # [rows, 1, D]
        self.cos[:rows].copy_(cos[:, 0])
        self.sin[:rows].copy_(sin[:, 0])
        self.residual[:rows].copy_(decoder.embed_tokens(input_ids))
        calls, attention = self._plan(rows)
        decode = metadata.decode
        pairs = decode.block_pairs()
        workspace = cpu_kernel.decode_workspace(rows, self.num_heads, self.head_dim,
                                                decode.max_seq_len)
        slots = metadata.slot_mapping.contiguous()
        stored = [call for call, store in attention if store is not None]
        for _, store in attention:  # an 8-bit cache: its store, then attention
            if store is not None:
                cpu_kernel.set_store_slots(store, slots)
        cpu_kernel.set_steps(stored, pairs, decode.seq_lens, decode.max_seq_len, None,
                             workspace)
        cpu_kernel.set_steps([call for call, store in attention if store is None], pairs,
                             decode.seq_lens, decode.max_seq_len, slots, workspace)
        for call in calls:
            call()
        return self.final[:rows]

    def _dot_workspace_floats(self) -> int:
        """The widest workspace the AVX512-BF16 products of the decoder's projections take at
        max_rows with the current thread count (it grows with rows), 0 where none runs."""
        floats = 0
        for layer in self.model.model.layers:
            for linear in _projections(layer):
                matmul = _matmul_of(linear, self.max_rows, self.dtype)
                if matmul is not None and matmul.runs_dot(self.max_rows, self.dtype):
                    floats = max(floats, matmul.dot_workspace_floats(self.max_rows))
        return floats

    def _plan(self, rows: int) -> tuple[list[Callable[[], object]],
                                        list[tuple[PreparedCall, PreparedCall | None]]]:
        plans = self._plans if self.chain else self._unchained
        plan = plans.get(rows)
        if plan is None:
            plan = plans[rows] = self._build(rows)
        return plan

    def _build(self, rows: int) -> tuple[list[Callable[[], object]],
                                         list[tuple[PreparedCall, PreparedCall | None]]]:
        """The step's calls for ``rows`` sequences, and the attention calls among them (with
        an 8-bit cache's store call, else None: the attention stores the step's K/V)."""
        decoder = self.model.model
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        residual, normed, qkv = self.residual[:rows], self.normed[:rows], self.qkv[:rows]
        view = qkv.view(rows, H + 2 * KVH, D)
        query = view[:, :H] if rows == 1 else self.query[:rows].view(rows, H, D)
        key, value = view[:, H:H + KVH], view[:, H + KVH:]
        attn_out = self.attn_out[:rows]
        calls: list[Callable[[], object]] = []
        attention: list[tuple[PreparedCall, PreparedCall | None]] = []
        for index, (layer, cache) in enumerate(zip(decoder.layers, self.kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            if index == 0:  # the embedding: norm alone, the residual stream starts as it
                calls.append(cpu_ops.prepared_rms_norm(residual, None, norm.weight, norm.eps,
                                                       normed, self.norm_scratch))
            else:
                calls.append(cpu_ops.prepared_rms_norm(self.down[:rows], residual,
                                                       norm.weight, norm.eps, normed,
                                                       self.norm_scratch))
            calls += _projection(attn.qkv_proj, normed, qkv, self.workspace)
            if attn.qk_norm:
                calls.append(self._norm_and_rotate(attn, view[:, :H], view[:, H:H + KVH],
                                                   rows))
            else:
                calls.append(cpu_ops.prepared_rotary(view[:, :H + KVH], self.cos[:rows],
                                                     self.sin[:rows]))
            if rows > 1:  # the queries gathered, as the layer's query.contiguous()
                calls.append(lambda dst=query, src=view[:, :H]: dst.copy_(src))
            out = attn_out.view(rows, H, D)
            store = None
            if isinstance(cache, QuantizedKVCache):
                store = cpu_kernel.prepared_store_quantized(key, value, cache)
                calls.append(store)
                call = cpu_kernel.prepared_decode_attention_quantized(
                    query, cache, out, attn.attn.scale, attn.attn.sliding_window)
            else:
                call = cpu_kernel.prepared_decode_attention(
                    query, *cache, out, key, value, attn.attn.scale, attn.attn.sliding_window)
            calls.append(call)
            attention.append((call, store))
            calls += _projection(attn.o_proj, attn_out, self.o_out[:rows], self.workspace)
            post = layer.post_attention_layernorm
            calls.append(cpu_ops.prepared_rms_norm(self.o_out[:rows], residual, post.weight,
                                                   post.eps, normed, self.norm_scratch))
            calls += _projection(mlp.gate_up_proj, normed, self.gate_up[:rows], self.workspace)
            calls.append(self._silu_and_mul(self.gate_up[:rows], self.act[:rows]))
            calls += _projection(mlp.down_proj, self.act[:rows], self.down[:rows],
                                 self.workspace)
        final = decoder.norm
        calls.append(cpu_ops.prepared_rms_norm(self.down[:rows], residual, final.weight,
                                               final.eps, self.final[:rows],
                                               self.norm_scratch))
        return (native.chain_calls(calls) if self.chain else calls), attention

    def _norm_and_rotate(self, attn: DecoderAttention, q: torch.Tensor, k: torch.Tensor,
                         rows: int) -> Callable[[], object]:
        """Qwen3's per-head q/k RMSNorm, then rotary, as the layer's forward computes them
        (the norm modules on the qkv views, RotaryEmbedding.apply out of place), written back
        into the views, where the attention reads q and the new K."""
        cos, sin = self.cos[:rows, None], self.sin[:rows, None]  # [rows, 1, D] as the forward's
        q_norm, k_norm, rotate = attn.q_norm, attn.k_norm, RotaryEmbedding.apply

        def call() -> None:
            rotated_q, rotated_k = rotate(q_norm(q), cos, sin), rotate(k_norm(k), cos, sin)
            q.copy_(rotated_q)
            k.copy_(rotated_k)
        return call

    @staticmethod
    def _silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
        """silu(gate) * up into ``out``, as DecoderMLP computes it: the compiled op where it
        runs for this dtype (bfloat16), else torch's."""
        if gate_up.dtype == torch.bfloat16 and cpu_ops.available(gate_up, "silu_and_mul"):
            return cpu_ops.prepared_silu_and_mul(gate_up, out)

        def call() -> None:
            gate, up = gate_up.chunk(2, dim=-1)
            out.copy_(F.silu(gate) * up)
        return call
