"""The serve/generate/chat commands: engine flags derived from EngineArgs, and ``pagellm
generate`` / ``pagellm chat`` run as real subprocesses against the offline API's output."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
from server_utils import ENGINE_FLAGS, cli_env

from pagellm import SamplingParams
from pagellm.config import EngineArgs
from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from


def run_cli(*args: str, stdin: str | None = None, timeout: float = 180):
    """Bytes decoded by hand: text mode would turn a generated "\r" into "\n"."""
    result = subprocess.run([sys.executable, "-m", "pagellm", *args],
                            input=stdin.encode() if stdin is not None else None,
                            capture_output=True, timeout=timeout,
                            env={**cli_env(), "PYTHONIOENCODING": "utf-8"})
    result.stdout = result.stdout.decode("utf-8")
    result.stderr = result.stderr.decode("utf-8", errors="replace")
    return result


def test_every_engine_arg_is_a_flag_with_vllm_spelling_and_default():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for field in dataclasses.fields(EngineArgs):
        if field.name != "model":
            assert "--" + field.name.replace("_", "-") in flags, field.name
    ns = parser.parse_args([])
    assert engine_args_from(ns, model="m") == EngineArgs(model="m")


def test_engine_flags_parse_to_engine_args():
    parser = build_parser()
    ns = parser.parse_args(["serve", "some/model", "--block-size", "32", "--swap-space", "0.5",
                            "--no-enable-prefix-caching", "--max-model-len", "1024",
                            "--preemption-mode", "recompute", "--num-gpu-blocks-override",
                            "none", "--api-key", "k"])
    args = engine_args_from(ns)
    assert (args.model, args.block_size, args.swap_space) == ("some/model", 32, 0.5)
    assert args.enable_prefix_caching is False and args.max_model_len == 1024
    assert args.preemption_mode == "recompute" and args.num_gpu_blocks_override is None
    assert ns.api_key == ["k"] and ns.host == "127.0.0.1" and ns.port == 8000
    assert ns.max_request_json_objects == 20_000
    assert parser.parse_args(["serve", "m", "--max-request-json-objects", "50000"]
                             ).max_request_json_objects == 50_000


def test_bad_engine_flag_value_names_the_field():
    ns = build_parser().parse_args(["generate", "m", "--prompt", "x", "--block-size", "0"])
    with pytest.raises(ValueError, match="block_size"):
        engine_args_from(ns)
    result = run_cli("generate", "m", "--prompt", "x", "--dtype", "float64", timeout=60)
    assert result.returncode == 2 and "dtype" in result.stderr


@pytest.mark.parametrize("flags, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--structured-outputs-in-reasoning"],
     "--structured-outputs-in-reasoning needs --reasoning-parser"),
])
def test_chat_flags_that_need_another(flags, message):
    from pagellm.entrypoints.commands.serve import _chat_options

    with pytest.raises(ValueError, match=message):
        _chat_options(build_parser().parse_args(["serve", "m", *flags]))
    options = _chat_options(build_parser().parse_args(
        ["serve", "m", "--reasoning-parser", "deepseek_r1", "--structured-outputs-in-reasoning"]))
    assert (options["reasoning_parser"], options["structured_outputs_in_reasoning"]) == (
        "deepseek_r1", True)


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_help_lists_engine_flags(command):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0


def test_help_text_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--block-size", "--swap-space", "--enable-prefix-caching",
                 "--gpu-memory-utilization", "--preemption-mode", "--api-key",
                 "--served-model-name"):
        assert flag in out


def test_generate_streams_the_greedy_text(tiny_model, reference_llm):
    prompt = "The block allocator"
    expected = reference_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                             ignore_eos=True), use_tqdm=False)
    for flag in ("--prompt", "-p"):
        result = run_cli("generate", str(tiny_model), flag, prompt, "--temperature", "0",
                         "--max-tokens", "12", "--ignore-eos", *ENGINE_FLAGS)
        assert result.returncode == 0, result.stderr
        assert result.stdout == prompt + expected[0].outputs[0].text + "\n"


def test_chat_keeps_the_conversation(tiny_model, reference_llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = reference_llm.chat([{"role": "user", "content": "hi"}], params,
                               use_tqdm=False)[0].outputs[0].text
    second = reference_llm.chat([{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": first},
                                 {"role": "user", "content": "more"}], params,
                                use_tqdm=False)[0].outputs[0].text
    fresh = reference_llm.chat([{"role": "user", "content": "again"}], params,
                               use_tqdm=False)[0].outputs[0].text
    result = run_cli("chat", str(tiny_model), "--temperature", "0", "--max-tokens", "6",
                     "--ignore-eos", *ENGINE_FLAGS, stdin="hi\nmore\n/reset\nagain\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{first}\n{second}\n{fresh}\n"
