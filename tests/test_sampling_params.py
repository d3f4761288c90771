"""SamplingParams: vLLM defaults, normalisation, and errors that name the field and the limit."""
from __future__ import annotations

import numpy as np
import pytest

from pagellm.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16, 0, None, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and not p.include_stop_str_in_output
    assert p.skip_special_tokens and p.spaces_between_special_tokens


def test_normalisation() -> None:
    p = SamplingParams(stop="###", top_k=-1, temperature=0, stop_token_ids=(3, np.int64(7)))
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.stop_token_ids == [3, 7] and all(type(t) is int for t in p.stop_token_ids)
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(n=np.int32(2)).n == 2


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1])
    q = p.clone()
    assert q == p
    q.stop.append("c")
    q.stop_token_ids.append(2)
    q.max_tokens = 99
    assert p.stop == ["a", "b"] and p.stop_token_ids == [1] and p.max_tokens == 16


def test_output_text_buffer_length() -> None:
    assert SamplingParams().output_text_buffer_length == 0
    assert SamplingParams(stop=["ab", "wxyz"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["wxyz"],
                          include_stop_str_in_output=True).output_text_buffer_length == 0


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"n": 0}, ["n", "0", "at least 1"]),
        ({"temperature": -0.1}, ["temperature", "-0.1", ">= 0"]),
        ({"top_p": 0.0}, ["top_p", "0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ["top_p", "1.5", "(0, 1]"]),
        ({"top_k": -2}, ["top_k", "-2", "at least 1"]),
        ({"min_p": 1.1}, ["min_p", "1.1", "[0, 1]"]),
        ({"min_p": -0.1}, ["min_p", "-0.1", "[0, 1]"]),
        ({"presence_penalty": 2.5}, ["presence_penalty", "2.5", "[-2, 2]"]),
        ({"frequency_penalty": -3}, ["frequency_penalty", "-3", "[-2, 2]"]),
        ({"repetition_penalty": 0.0}, ["repetition_penalty", "0.0", "> 0"]),
        ({"max_tokens": 0}, ["max_tokens", "0", "at least 1"]),
        ({"min_tokens": -1}, ["min_tokens", "-1", ">= 0"]),
        ({"min_tokens": 5, "max_tokens": 4}, ["min_tokens", "5", "max_tokens=4"]),
        ({"logprobs": -1}, ["logprobs", "-1", str(MAX_LOGPROBS)]),
        ({"logprobs": MAX_LOGPROBS + 1}, ["logprobs", str(MAX_LOGPROBS + 1), "MAX_LOGPROBS"]),
        ({"prompt_logprobs": 21}, ["prompt_logprobs", "21", "20"]),
        ({"stop": ["ok", ""]}, ["stop", "''", "empty"]),
        ({"stop": [1, 2]}, ["stop", "[1, 2]", "list of str"]),
        ({"stop": 5}, ["stop", "5"]),
        ({"stop_token_ids": [1, -4]}, ["stop_token_ids", "-4", "non-negative"]),
        ({"stop_token_ids": ["x"]}, ["stop_token_ids", "'x'", "int"]),
        ({"stop_token_ids": 7}, ["stop_token_ids", "7", "list of int"]),
        ({"n": 1.5}, ["n", "1.5", "int"]),
        ({"max_tokens": True}, ["max_tokens", "True", "int"]),
        ({"seed": "42"}, ["seed", "'42'", "int"]),
        ({"temperature": "hot"}, ["temperature", "'hot'", "real number"]),
        ({"temperature": float("nan")}, ["temperature", "nan", "finite"]),
        ({"top_p": float("inf")}, ["top_p", "inf", "finite"]),
        ({"ignore_eos": 1}, ["ignore_eos", "1", "bool"]),
    ],
)
def test_invalid_values_name_field_value_and_limit(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(words[0] + " "), message
    for word in words[1:]:
        assert word in message, (word, message)


def test_boundaries_accepted() -> None:
    SamplingParams(top_p=1e-9, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=1e-3, logprobs=0, prompt_logprobs=MAX_LOGPROBS,
                   min_tokens=16, max_tokens=16, top_k=1, temperature=0)
