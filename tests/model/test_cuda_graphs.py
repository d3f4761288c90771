"""Decode steps padded to a captured batch size (worker/cuda_graphs.py), checked on the CPU.

The graph capture itself needs CUDA (tests/model/test_cuda_path.py, marked gpu). What it
replays is tested here: the padded forward over the static buffers, run eagerly with the
Triton kernels under TRITON_INTERPRET=1 (the kernels a graph captures): which size a batch
maps to, how inputs are padded, that padding rows write nothing to the KV cache and that
their rows never reach the logits.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton_backend defines its kernels

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import random_prompts  # noqa: E402

from pagellm.attention import AttentionMetadata, kv_quant  # noqa: E402
from pagellm.model import load_model  # noqa: E402
from pagellm.worker.cache_engine import CacheEngine  # noqa: E402
from pagellm.worker.cuda_graphs import (MAX_CAPTURE_SIZE, DecodeBuffers,  # noqa: E402
                                        DecodeGraphRunner, capture_sizes, padded_size)
from pagellm.worker.model_runner import ModelRunner, ScheduledSeq  # noqa: E402


def test_capture_sizes_follow_the_ladder_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 3 + 32
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE


@pytest.mark.parametrize("num_seqs, expected", [(1, 1), (3, 4), (5, 8), (8, 8), (9, 16),
                                                (17, 24), (32, 32), (33, None)])
def test_a_batch_pads_to_the_next_captured_size(num_seqs, expected):
    assert padded_size(num_seqs, capture_sizes(32)) == expected


def test_fill_copies_the_batch_and_pads_the_rest():
    buffers = DecodeBuffers.allocate(8, 6, "cpu")
    metadata = AttentionMetadata.build([1, 1, 1], [5, 9, 2], [[7, 3], [4, 1, 9], [2]], 4)
    buffers.fill(torch.tensor([11, 12, 13]), metadata, size=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [4, 8, 1, 0]
    assert buffers.slot_mapping[:4].tolist() == [3 * 4 + 0, 9 * 4 + 0, 2 * 4 + 1, -1]
    assert buffers.seq_lens[:4].tolist() == [5, 9, 2, 1]
    assert buffers.block_tables[:4, :3].tolist() == [[7, 3, 0], [4, 1, 9], [2, 0, 0], [0, 0, 0]]
    assert buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    view = buffers.metadata(4, max_model_len=24, block_size=4)
    assert (view.num_prefills, view.num_decode_tokens, view.write_index) == (0, 4, None)
    assert view.block_tables.shape == (4, 6) and view.decode.block_tables.shape == (4, 6)
    with pytest.raises(ValueError, match="exceed the captured 6"):
        wide = AttentionMetadata.build([1], [30], [list(range(8))], 4)
        buffers.fill(torch.tensor([1]), wide, size=1)


@pytest.fixture(scope="module")
def tiny_model(model_zoo):
    path, _ = model_zoo("llama")
    return load_model(path)


def prefilled_runner(tiny_model, prompts, tables, kv_format=None) -> ModelRunner:
    model, config = tiny_model
    runner = ModelRunner(model, CacheEngine(config, 16, 0, 8, torch.float32, "cpu", kv_format),
                         "cpu")
    runner.cache_engine.device_cache[:, :, 0] = 7  # block 0: what padding rows read
    runner.execute([ScheduledSeq(p, 0, len(p) - 1, t, False) for p, t in zip(prompts, tables)])
    return runner


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3"])
def test_padded_decode_matches_eager_and_padding_writes_nothing(tiny_model, kv_cache_dtype,
                                                                monkeypatch):
    """With an 8-bit cache too: its Triton store skips the padding rows in the kernel."""
    monkeypatch.setenv("PAGELLM_ATTENTION_BACKEND", "triton")
    prompts = random_prompts([12, 5, 17], seed=5)
    tables = [[3, 4], [6], [9, 10, 11]]
    kv_format = kv_quant.kv_format(kv_cache_dtype)
    eager = prefilled_runner(tiny_model, prompts, tables, kv_format)
    padded = prefilled_runner(tiny_model, prompts, tables, kv_format)
    padded.decode_graphs = DecodeGraphRunner(padded.model, padded.cache_engine.kv_caches,
                                             [1, 2, 4], max_model_len=64, block_size=8,
                                             device="cpu")
    batch = [ScheduledSeq(p, len(p) - 1, 1, t, need_logits=True)
             for p, t in zip(prompts, tables)]
    expected = eager.execute(batch)
    rows_seen = []  # the two runners share the model
    compute_logits = padded.model.compute_logits
    monkeypatch.setattr(padded.model, "compute_logits",
                        lambda h: rows_seen.append(h.shape[0]) or compute_logits(h))
    got = padded.execute(batch)  # 3 sequences, padded to 4
    assert rows_seen == [3] and got.shape == expected.shape == (3, 512)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # The same slots were written, and nothing else: block 0 and every free block unchanged.
    torch.testing.assert_close(padded.cache_engine.device_cache, eager.cache_engine.device_cache,
                               atol=1e-5 if kv_format is None else 0, rtol=0)
    assert bool((padded.cache_engine.device_cache[:, :, 0] == 7).all())
    assert padded.decode_graphs.buffers.slot_mapping[3] == -1


def test_prefills_and_batches_beyond_the_largest_size_run_eagerly(tiny_model):
    model, config = tiny_model
    cache = CacheEngine(config, 4, 0, 8, torch.float32, "cpu")
    graphs = DecodeGraphRunner(model, cache.kv_caches, [1, 2], 64, 8, "cpu")
    prefill = AttentionMetadata.build([4], [4], [[0]], 8)
    assert graphs.run(torch.zeros(4, dtype=torch.int64), prefill) is None
    three = AttentionMetadata.build([1, 1, 1], [2, 2, 2], [[0], [1], [2]], 8)
    assert graphs.run(torch.zeros(3, dtype=torch.int64), three) is None
