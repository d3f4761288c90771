"""`pagellm kv-calc` through the CLI dispatcher."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagellm.entrypoints.cli import main

SEED_EXAMPLE = ["kv-calc", "--preset", "llama-2-70b", "--dtype", "float16", "--batch", "32",
                "--seq-len", "2048"]


def run_json(capsys, *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_seed_example_json(capsys):
    report = run_json(capsys, *SEED_EXAMPLE)
    assert report["bytes_per_token"] == 327_680
    assert report["bytes_per_token_if_mha"] == 2_621_440
    assert report["total_bytes"] == 21_474_836_480
    assert report["total_bytes_if_mha"] == 160 * 1024**3
    assert (report["num_attention_heads"], report["num_kv_heads"]) == (64, 8)


def test_seed_example_human_form_explains_the_correction(capsys):
    assert main(SEED_EXAMPLE) == 0
    text = " ".join(capsys.readouterr().out.split())  # the prose is wrapped
    assert "Counting all 64 heads, as for multi-head attention" in text
    assert "2.5 MiB per token and 160 GiB" in text
    assert "8 KV heads" in text and "0.3125 MiB per token and 20 GiB" in text
    assert "327,680 bytes" in text


def test_memory_budget_gives_capacity(capsys):
    report = run_json(capsys, *SEED_EXAMPLE, "--memory", "40GiB", "--block-size", "16")
    assert report["memory_bytes"] == 40 * 1024**3
    assert (report["num_blocks"], report["capacity_tokens"], report["max_concurrency"]) == \
        (8192, 131_072, 64)
    assert main([*SEED_EXAMPLE, "--memory", "40GiB"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "at most 64 sequences of 2,048 tokens at once" in text


def test_multi_head_model_says_so(capsys):
    assert main(["kv-calc", "--preset", "llama-2-7b"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "multi-head attention" in text and "0.5 MiB" in text


def test_model_dir_and_config_file(tmp_path, capsys):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "hidden_size": 256, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    by_dir = run_json(capsys, "kv-calc", "--model", str(tmp_path))
    by_file = run_json(capsys, "kv-calc", "--config", str(tmp_path / "config.json"))
    assert by_dir["bytes_per_token"] == by_file["bytes_per_token"] == 2 * 4 * 2 * 32 * 4


def test_user_errors_exit_2(tmp_path, capsys):
    assert main(["kv-calc", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
    for bad in (["--memory", "lots"], ["--batch", "0"], ["--preset", "nope"]):
        with pytest.raises(SystemExit) as exc:
            main(["kv-calc", "--preset", "llama-2-7b", *bad])
        assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main(["kv-calc"])  # a model source is required


def test_dtype_is_the_model_dtype_as_for_serve(capsys):
    """--dtype names the model dtype (the KV cache's unless --kv-cache-dtype overrides it), as
    for serve and vLLM; an 8-bit dtype there is a usage error pointing to --kv-cache-dtype."""
    preset = ["kv-calc", "--preset", "llama-2-7b"]
    assert run_json(capsys, *preset, "--dtype", "bf16")["dtype"] == "bfloat16"
    report = run_json(capsys, *preset, "--dtype", "float32", "--kv-cache-dtype", "int8")
    assert (report["dtype"], report["bytes_per_token"]) == ("int8", 2 * 32 * 32 * (128 + 2))
    assert run_json(capsys, *preset, "--kv-cache-dtype", "auto")["dtype"] == "float16"
    for bad, message in (("int8", "'int8' is not a model dtype: auto, float16, bfloat16, "
                                  "float32; an int8 KV cache is --kv-cache-dtype int8"),
                         ("fp4", "'fp4' is not a model dtype: auto, float16, bfloat16, float32")):
        with pytest.raises(SystemExit) as exc:
            main([*preset, "--dtype", bad])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert main([*preset, "--kv-cache-dtype", "int4"]) == 2
    assert "unknown KV cache dtype 'int4'" in capsys.readouterr().err


def test_kv_package_imports_no_torch():
    code = ("import sys, pagellm.kv, pagellm.entrypoints.commands.kv_calc;"
            "assert 'torch' not in sys.modules, 'pagellm.kv imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_gguf_file_is_sized_as_the_engine_sizes_it(capsys, kv_dtype):
    """--model takes a GGUF file, as LLM(model=...) does: the real model's KV bytes per token
    and per block are the engine's for its cache dtype (the file's Q4_1 weights load in
    bfloat16; SmolLM2-135M: 30 layers, 3 KV heads of 64)."""
    import torch

    from gguf_models import smollm2_gguf
    from pagellm.attention import kv_quant
    from pagellm.model.loader import load_config, resolve_dtype
    from pagellm.worker.cache_engine import CacheEngine

    path = smollm2_gguf()
    report = run_json(capsys, "kv-calc", "--model", str(path), "--kv-cache-dtype", kv_dtype)
    config = load_config(path)
    engine_bytes = CacheEngine.bytes_per_block(config, 16, resolve_dtype("auto", config),
                                               kv_quant.kv_format(kv_dtype))
    assert report["bytes_per_block"] == engine_bytes
    row = 64 * 2 if kv_dtype == "auto" else 64 + 2
    assert report["bytes_per_token"] == 2 * 30 * 3 * row
    assert report["dtype"] == ("bfloat16" if kv_dtype == "auto" else "int8")
    assert report["model"] == path.name
    assert resolve_dtype("auto", config) == torch.bfloat16


def test_tiny_gguf_file_dtypes(tmp_path, capsys):
    """A file without general.file_type loads in bfloat16, as the engine loads it; --dtype
    float32 counts 4 bytes."""
    from gguf_models import TINY_GGUF, write_tiny_gguf
    from pagellm.model.loader import load_config, resolve_dtype

    path, _ = write_tiny_gguf(tmp_path, "F32")
    head_dim = TINY_GGUF["hidden_size"] // TINY_GGUF["num_attention_heads"]
    per_element = 2 * TINY_GGUF["num_hidden_layers"] * TINY_GGUF["num_key_value_heads"] * head_dim
    report = run_json(capsys, "kv-calc", "--model", str(path))
    assert report["dtype"] == str(resolve_dtype("auto", load_config(path))).removeprefix("torch.")
    assert (report["num_kv_heads"], report["head_dim"]) == (TINY_GGUF["num_key_value_heads"],
                                                            head_dim)
    assert report["bytes_per_token"] == per_element * report["dtype_bytes"]
    report = run_json(capsys, "kv-calc", "--model", str(path), "--dtype", "float32")
    assert report["bytes_per_token"] == per_element * 4
