"""Structured outputs and token restrictions through the offline API on a tiny random model:
outputs match their constraint even from random weights at temperature 1, unconstrained
requests in the same batch are unaffected, grammar state survives forks (n > 1) and preemption
by recompute, and bad specs are ValueErrors naming the field."""
from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.bench.random_model import build_random_model  # noqa: E402
from pagellm.structured_outputs import StructuredOutputsParams  # noqa: E402
from pagellm.worker.grammar import bitmask_to_bias, unpack_bitmask  # noqa: E402

KWARGS = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=256, swap_space=0.05)
SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["id", "name", "tags", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("so") / "tiny", seed=1)


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), **KWARGS)


def _json(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMA, **kw)


def test_json_schema_valid_at_temperature_one_with_forks(llm):
    params = SamplingParams(temperature=1.0, max_tokens=200, n=4, seed=7,
                            structured_outputs=_json())
    out = llm.generate(["Hello", "The cat sat"], params, use_tqdm=False)
    for request in out:
        for c in request.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in out[0].outputs}) > 1  # the samples differ


def test_unconstrained_rows_unaffected_by_constrained_neighbours(llm):
    plain = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    alone = llm.generate(["Tell me a story"], plain, use_tqdm=False)[0].outputs[0]
    constrained = SamplingParams(temperature=1.0, max_tokens=100, seed=3,
                                 structured_outputs=_json())
    mixed = llm.generate(["a", "Tell me a story", "b"], [constrained, plain, constrained],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.token_ids
    for i in (0, 2):
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMA)


def test_grammar_state_survives_preemption_by_recompute(model, llm):
    prompts = [f"prompt number {i} about paged attention" for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=_json())
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight_kwargs = {**KWARGS, "num_gpu_blocks_override": 10, "block_size": 16,
                    "max_model_len": 128}
    tight = LLM(str(model), preemption_mode="recompute", **tight_kwargs)
    out = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in roomy]
    for o in out:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("spec,check", [
    (dict(choice=["yes", "no", "maybe"]), lambda t: t in ("yes", "no", "maybe")),
    (dict(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    (dict(grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]/'),
     lambda t: re.fullmatch(r"\([0-9](,[0-9])*\)", t)),
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_other_kinds(llm, spec, check):
    params = SamplingParams(temperature=1.0, max_tokens=120, n=3, seed=5,
                            structured_outputs=StructuredOutputsParams(**spec))
    for c in llm.generate(["x"], params, use_tqdm=False)[0].outputs:
        if c.finish_reason == "length":  # only an unbounded grammar may run out of tokens
            assert "json_object" in spec or "grammar" in spec
            continue
        assert check(c.text), c.text


def test_compiled_once_per_spec(llm):
    compiler = llm.llm_engine.grammar_compiler
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}
    before = compiler.num_compiled
    for _ in range(3):
        llm.generate(["x"], SamplingParams(max_tokens=20, structured_outputs=
                                           StructuredOutputsParams(json=dict(schema))),
                     use_tqdm=False)
    assert compiler.num_compiled == before + 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(regex="[a-"), "structured_outputs.regex"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
])
def test_invalid_specs_are_value_errors(llm, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)),
                     use_tqdm=False)


def test_spec_needs_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()


def test_allowed_token_ids_and_bad_words(llm):
    out = llm.generate(["x"], SamplingParams(temperature=1.0, max_tokens=30, seed=1,
                                             allowed_token_ids=[5, 6, 7]), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= {5, 6, 7}
    tokenizer = llm.get_tokenizer()
    (a,), (b,) = (tokenizer.encode(t, add_special_tokens=False) for t in ("a", "b"))
    both = SamplingParams(temperature=100.0, max_tokens=30, seed=2, allowed_token_ids=[a, b])
    assert set(llm.generate(["x"], both, use_tqdm=False)[0].outputs[0].token_ids) == {a, b}
    banned = SamplingParams(temperature=100.0, max_tokens=30, seed=2, allowed_token_ids=[a, b],
                            bad_words=["a"])
    assert set(llm.generate(["x"], banned, use_tqdm=False)[0].outputs[0].token_ids) == {b}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_bitmask_to_bias_matches_the_bit_loop():
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    expected = torch.tensor([[(int(words[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(100)]
                             for r in range(3)])
    assert torch.equal(unpack_bitmask(words, 100), expected)
    bias = bitmask_to_bias(words, 100)
    assert bias.shape == (3, 100)
    assert torch.equal(bias == 0, expected) and torch.isneginf(bias[~expected]).all()


def test_offline_chat_passes_tools_and_template_controls(llm):
    template = ("{% if tools %}T{{ tools | length }}{% endif %}{% if shout %}X{% endif %}"
                "{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}>{% endif %}")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                   use_tqdm=False, chat_template=template, tools=tools,
                   chat_template_kwargs={"shout": True})
    assert llm.get_tokenizer().decode(out[0].prompt_token_ids) == "T1Xhi>"
    out = llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
                   SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template,
                   continue_final_message=True)
    assert llm.get_tokenizer().decode(out[0].prompt_token_ids) == "hiok"


@pytest.mark.parametrize("kwargs,field", [
    (dict(logit_bias={5: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"), (dict(allowed_token_ids=[]),
                                                          "allowed_token_ids"),
    (dict(allowed_token_ids=[-3]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words"),
    (dict(structured_outputs={"regex": "a"}), "structured_outputs"),
])
def test_restriction_values_checked(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs)


def test_logit_bias_steers_sampling(llm):
    (a,) = llm.get_tokenizer().encode("a", add_special_tokens=False)
    params = SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True,
                            logit_bias={a: 100.0})
    assert llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].token_ids == [a] * 8
