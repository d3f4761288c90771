"""Extreme sampling values (0, subnormals, 1e±300, inf, NaN, huge lists): SamplingParams refuses
them with a ValueError naming the field, or the sampler returns a valid token id, whatever the
logits (NaN, inf, every token banned). Never an id outside the vocabulary."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.sampling_params import (MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE,
                                     SamplingParams)
from pagellm.worker.sampler import Sampler, SamplingMetadata

VOCAB = 32
EOS = 2
EXTREME = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-46, 1e-38, 1.2e-38, 1e-5, 0.5, 1.0,
                           2.0, 3.0, 1e3, 1e4, 1e38, 1e300, -1e300, -1.0, -2.0,
                           math.inf, -math.inf, math.nan])
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty")
SPECIAL_LOGITS = st.sampled_from([0.0, 1.0, -1.0, 1e30, -1e30, 3e38, -3e38, math.inf,
                                  -math.inf, math.nan])


def _params_or_none(kwargs: dict) -> SamplingParams | None:
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        assert field in kwargs, (field, kwargs)  # the message names a field that was set
        return None


@st.composite
def params_kwargs(draw) -> dict:
    kwargs = {name: draw(EXTREME) for name in draw(st.sets(st.sampled_from(FLOAT_FIELDS)))}
    if draw(st.booleans()):
        kwargs["top_k"] = draw(st.sampled_from([-1, 0, 1, 5, VOCAB, 10**9]))
    if draw(st.booleans()):
        kwargs["min_tokens"] = draw(st.integers(0, 4))
        kwargs["max_tokens"] = 8
        kwargs["stop_token_ids"] = draw(st.lists(st.integers(0, VOCAB - 1), max_size=VOCAB))
    kwargs["ignore_eos"] = draw(st.booleans())
    kwargs["seed"] = draw(st.sampled_from([None, 0, 2**63 - 1]))
    return kwargs


@st.composite
def logits_rows(draw, rows: int) -> torch.Tensor:
    base = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(draw(st.integers(0, 9))))
    for _ in range(draw(st.integers(0, 3 * VOCAB))):
        base[draw(st.integers(0, rows - 1)), draw(st.integers(0, VOCAB - 1))] = draw(SPECIAL_LOGITS)
    if draw(st.booleans()):
        base[draw(st.integers(0, rows - 1))] = draw(SPECIAL_LOGITS)  # a whole row
    return base


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(params_kwargs(), min_size=1, max_size=4), st.data())
def test_extreme_values_are_refused_or_sampled_in_vocabulary(kwargs_list, data):
    params = [p for p in map(_params_or_none, kwargs_list) if p is not None]
    if not params:
        return
    logits = data.draw(logits_rows(len(params)))
    before = logits.clone()
    outputs = [data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=6)) for _ in params]
    generators = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None
                  for p in params]
    for p in params:
        p.logprobs = data.draw(st.sampled_from([None, 0, 3]))
    meta = SamplingMetadata(params, [[1, 3, 3]] * len(params), outputs, generators)
    out = Sampler(VOCAB, EOS)(logits, meta)
    assert all(isinstance(t, int) and 0 <= t < VOCAB for t in out.token_ids), out.token_ids
    assert torch.equal(before.nan_to_num(nan=7.0), logits.nan_to_num(nan=7.0))


def test_float32_overflow_and_underflow_are_refused():
    for kwargs, words in [({"temperature": 1e300}, [str(MAX_TEMPERATURE).rstrip("0").rstrip(".")]),
                          ({"repetition_penalty": 1e-300}, ["repetition_penalty", "[0.001"]),
                          ({"repetition_penalty": 1e-46}, ["repetition_penalty"]),
                          ({"top_p": 1e-46}, ["top_p", "float32"]),
                          ({"min_p": 5e-324}, ["min_p", "float32"])]:
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs)
        assert all(w in str(info.value) for w in words), str(info.value)


def test_huge_lists_are_refused():
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} strings"):
        SamplingParams(stop=["x"] * 300_000)
    with pytest.raises(ValueError, match="at most 256 characters"):
        SamplingParams(stop=["x" * 10_000])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_TOKEN_IDS} ids"):
        SamplingParams(stop_token_ids=list(range(10**6)))


@pytest.mark.parametrize("row", [[math.nan] * VOCAB, [-math.inf] * VOCAB,
                                 [math.inf] * VOCAB, [0.0] * (VOCAB - 1) + [math.nan]])
@pytest.mark.parametrize("temperature", [0.0, 1.0, MAX_TEMPERATURE])
def test_degenerate_rows_give_a_token_id(row, temperature):
    params = [SamplingParams(temperature=temperature, top_p=0.5, min_p=0.1),
              SamplingParams(temperature=1.0)]
    logits = torch.tensor([row, [0.0] * VOCAB])
    out = Sampler(VOCAB, EOS)(logits, SamplingMetadata(params, [[1]] * 2, [[]] * 2, [None] * 2))
    assert all(0 <= t < VOCAB for t in out.token_ids)


def test_min_tokens_banning_every_token_still_gives_a_token_id():
    """The engine refuses such a request; the sampler must stay in range all the same."""
    p = SamplingParams(temperature=1.0, min_tokens=3, max_tokens=5,
                       stop_token_ids=list(range(VOCAB)))
    out = Sampler(VOCAB, EOS)(torch.randn(1, VOCAB), SamplingMetadata([p], [[1]], [[]], [None]))
    assert 0 <= out.token_ids[0] < VOCAB
