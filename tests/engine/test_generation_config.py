"""generation_config.json: the model's recommended sampling values fill in the fields a request
did not set (offline and server), generation_config="vllm" turns that off, and its extra EOS
tokens end generation."""
from __future__ import annotations

import argparse
import json
import shutil

import pytest

from pagellm import LLM, SamplingParams
from pagellm.entrypoints.commands.engine_flags import add_engine_flags, engine_args_from

RECOMMENDED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1}
ENGINE = dict(num_gpu_blocks_override=64, max_model_len=256, swap_space=0.01)


@pytest.fixture(scope="module")
def model_with_generation_config(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("generation") / "model"
    shutil.copytree(llama_dir, out)
    config = json.loads((out / "generation_config.json").read_text()) \
        if (out / "generation_config.json").exists() else {}
    (out / "generation_config.json").write_text(json.dumps({**config, **RECOMMENDED}))
    return out


def _resolved(llm: LLM, params: SamplingParams | None) -> SamplingParams:
    engine = llm.llm_engine
    engine.add_request("probe", [5, 6, 7], params)
    resolved = engine.requests["probe"].params
    engine.abort_request("probe")
    return resolved


def test_recommended_values_fill_only_unset_fields(model_with_generation_config):
    llm = LLM(str(model_with_generation_config), **ENGINE)
    unset = _resolved(llm, SamplingParams(max_tokens=4))
    assert {k: getattr(unset, k) for k in RECOMMENDED} == RECOMMENDED
    assert _resolved(llm, None).temperature == 0.6
    # A value set explicitly wins, even when it equals the engine's own default.
    explicit = _resolved(llm, SamplingParams(max_tokens=4, temperature=1.0, top_k=0))
    assert (explicit.temperature, explicit.top_k, explicit.top_p) == (1.0, 0, 0.95)
    assert llm.get_default_sampling_params().top_k == 20
    user_params = SamplingParams(max_tokens=4)
    _resolved(llm, user_params)
    assert user_params.temperature == 1.0  # the caller's object is never changed


def test_vllm_setting_keeps_the_engine_defaults(model_with_generation_config):
    llm = LLM(str(model_with_generation_config), generation_config="vllm", **ENGINE)
    params = _resolved(llm, SamplingParams(max_tokens=4))
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 0)
    with pytest.raises(ValueError, match="generation_config='/nowhere'"):
        LLM(str(model_with_generation_config), generation_config="/nowhere", **ENGINE)


def test_generation_config_eos_ids_end_generation(llama_dir, tmp_path):
    prompt = [{"prompt_token_ids": [5, 9, 33, 2 + 100]}]
    greedy = dict(temperature=0.0, max_tokens=12)
    free = LLM(str(llama_dir), **ENGINE).generate(
        prompt, SamplingParams(ignore_eos=True, **greedy), use_tqdm=False)[0].outputs[0]
    stop_token = free.token_ids[3]
    first = free.token_ids.index(stop_token)
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [stop_token]}))
    out = LLM(str(model), **ENGINE).generate(prompt, SamplingParams(**greedy),
                                             use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop"


def test_server_leaves_unsent_sampling_fields_unset():
    from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagellm.entrypoints.openai.serving import sampling_params

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], top_p=0.5)
    params = sampling_params(body, max_tokens=8, logprobs=None)
    assert "top_p" in params.user_set_fields and "temperature" not in params.user_set_fields
    assert params.with_defaults(RECOMMENDED).temperature == 0.6
    assert params.with_defaults(RECOMMENDED).top_p == 0.5


def test_cli_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_flags(parser)
    args = engine_args_from(parser.parse_args(["m", "--generation-config", "vllm"]))
    assert args.generation_config == "vllm"
    assert engine_args_from(parser.parse_args(["m"])).generation_config == "auto"
