"""Multi-LoRA serving through the offline API against transformers + peft (float32 greedy):
a mixed batch of adapters and the base model, adapter-keyed prefix caching, more adapters than
device slots (and than CPU slots), and the errors a user can cause."""
from __future__ import annotations

import json

import pytest
from lora_adapters import ADAPTERS, MAX_LORA_RANK, make_peft_adapter
from helpers import random_prompts

from pagellm import LLM, LoRARequest, SamplingParams

MAX_NEW_TOKENS = 12
ENGINE_KWARGS = dict(dtype="float32", enable_lora=True, max_lora_rank=MAX_LORA_RANK,
                     num_gpu_blocks_override=96, max_model_len=256, swap_space=0.01,
                     block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def lora(adapters, name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, ADAPTERS[name][0], str(adapters[name]))


def generate(llm, prompts, names, adapters, params=GREEDY):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                           lora_request=[lora(adapters, n) for n in names], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], outputs


def check_against_peft(greedy_reference, prompts, names, tokens):
    for prompt, name, got in zip(prompts, names, tokens):
        assert got == greedy_reference(name, prompt, MAX_NEW_TOKENS), name


def record_step_adapters(llm) -> list[set[int]]:
    """The distinct adapter ids of every plan the scheduler hands out."""
    scheduler = llm.llm_engine.scheduler
    schedule, steps = scheduler.schedule, []

    def recording():
        plan = schedule()
        steps.append({s.lora_request.lora_int_id for s in plan.scheduled if s.lora_request})
        return plan

    scheduler.schedule = recording
    return steps


# a mixed batch: every adapter, some twice, and requests without adapter among them
NAMES = [None, "all-r4", "qv-r8-rslora", "mlp-r16-patterns", "all-r4", None,
         "mlp-r16-patterns", "qv-r8-rslora"]


def test_mixed_batch_matches_peft_per_adapter(lora_zoo, greedy_reference):
    base, adapters = lora_zoo
    llm = LLM(str(base), max_loras=3, **ENGINE_KWARGS)
    prompts = random_prompts([5, 17, 40, 9, 23, 31, 12, 27], seed=4)
    steps = record_step_adapters(llm)
    tokens, _ = generate(llm, prompts, NAMES, adapters)
    check_against_peft(greedy_reference, prompts, NAMES, tokens)
    assert max(map(len, steps)) == 3  # the adapters really ran in the same steps
    # each adapter changes the model: its tokens differ from the base model's on the prompt
    for prompt, name, got in zip(prompts, NAMES, tokens):
        if name is not None:
            assert got != greedy_reference(None, prompt, MAX_NEW_TOKENS), name
    stats = llm.llm_engine.get_stats().lora
    assert stats["num_slot_evictions"] == 0 and stats["num_loads"] == 3
    # chat takes the adapter too: the same tokens as generate on the templated prompt
    messages = [{"role": "user", "content": "Hi"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, lora_request=lora(adapters, "all-r4"))
    ids = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)
    assert list(chat[0].outputs[0].token_ids) == greedy_reference("all-r4", ids,
                                                                  MAX_NEW_TOKENS)


def test_chunked_prompts_and_decodes_mix_adapters(lora_zoo, greedy_reference):
    """A small token budget splits prompts into chunks that share steps with other
    adapters' decodes: each token still gets its own sequence's adapter."""
    base, adapters = lora_zoo
    llm = LLM(str(base), max_loras=3, max_num_batched_tokens=16, **ENGINE_KWARGS)
    prompts = random_prompts([45, 3, 30, 8], seed=5)
    names = ["mlp-r16-patterns", "all-r4", None, "qv-r8-rslora"]
    tokens, _ = generate(llm, prompts, names, adapters)
    check_against_peft(greedy_reference, prompts, names, tokens)


def test_prefix_cache_is_per_adapter(lora_zoo, greedy_reference):
    base, adapters = lora_zoo
    llm = LLM(str(base), max_loras=2, **ENGINE_KWARGS)
    prompt = random_prompts([41], seed=6)[0]  # 5 full blocks of 8
    cached = {}
    for name in ["all-r4", "qv-r8-rslora", None, "all-r4"]:
        tokens, outputs = generate(llm, [prompt], [name], adapters)
        check_against_peft(greedy_reference, [prompt], [name], tokens)
        cached.setdefault(name, []).append(outputs[0].num_cached_tokens)
    # the first sight of the prompt under each adapter (and the base model) hits nothing,
    # though the same tokens sit in the cache under another adapter; the same adapter hits
    assert cached == {"all-r4": [0, 40], "qv-r8-rslora": [0], None: [0]}


def test_more_adapters_than_slots(lora_zoo, greedy_reference):
    """One device slot and one CPU slot for three adapters: a step never holds two adapters,
    every request completes correctly, slots are evicted and adapters reloaded from disk."""
    base, adapters = lora_zoo
    llm = LLM(str(base), max_loras=1, max_cpu_loras=1, **ENGINE_KWARGS)
    prompts = random_prompts([7, 19, 11, 26, 14, 9], seed=7)
    names = ["all-r4", "qv-r8-rslora", "mlp-r16-patterns", None, "qv-r8-rslora", "all-r4"]
    steps = record_step_adapters(llm)
    tokens, _ = generate(llm, prompts, names, adapters)
    check_against_peft(greedy_reference, prompts, names, tokens)
    assert max(map(len, steps)) == 1
    stats = llm.llm_engine.get_stats().lora
    assert stats["num_slot_evictions"] >= 2 and stats["num_cpu_evictions"] >= 2
    assert stats["num_resident"] == 1 and stats["num_cpu_cached"] == 1


def test_remove_and_list_adapters(lora_zoo):
    base, adapters = lora_zoo
    llm = LLM(str(base), max_loras=2, **ENGINE_KWARGS)
    engine = llm.llm_engine
    first, second = lora(adapters, "all-r4"), lora(adapters, "qv-r8-rslora")
    assert engine.add_lora(first) and engine.add_lora(second)
    assert [r.lora_name for r in engine.list_loras()] == ["all-r4", "qv-r8-rslora"]
    with pytest.raises(ValueError, match="lora_int_id=1 already names adapter 'all-r4'"):
        engine.add_lora(LoRARequest("other", 1, str(adapters["qv-r8-rslora"])))
    assert engine.remove_lora(1) and not engine.remove_lora(1)
    assert [r.lora_name for r in engine.list_loras()] == ["qv-r8-rslora"]
    engine.add_lora(LoRARequest("other", 1, str(adapters["qv-r8-rslora"])))  # id free again


def test_lora_errors(lora_zoo, tmp_path):
    base, adapters = lora_zoo
    plain = LLM(str(base), dtype="float32", num_gpu_blocks_override=64, max_model_len=128,
                swap_space=0.01)
    with pytest.raises(ValueError, match="without enable_lora=True"):
        plain.generate([[5, 6, 7]], GREEDY, lora_request=lora(adapters, "all-r4"))
    llm = LLM(str(base), max_loras=1, **{**ENGINE_KWARGS, "max_lora_rank": 8})
    with pytest.raises(ValueError, match="rank 16, above max_lora_rank=8"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=lora(adapters, "mlp-r16-patterns"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_request has 2 entries but there are 1 prompts"):
        llm.generate([[5, 6, 7]], GREEDY, lora_request=[None, None])
    assert not llm.llm_engine.has_unfinished_requests()
    for name, config, message in [
            ("embed", dict(target_modules=["embed_tokens", "q_proj"]),
             r"target_modules \['embed_tokens'\] not supported"),
            ("head", dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
             "modules_to_save"),
            ("head-pair", dict(target_modules=["q_proj", "lm_head"]), r"\['lm_head'\]"),
            ("dora", dict(target_modules=["q_proj"], use_dora=True), "DoRA")]:
        folder = make_peft_adapter(base, tmp_path / name, seed=1, r=4, **config)
        with pytest.raises(ValueError, match=message):
            llm.llm_engine.add_lora(LoRARequest(name, 20, str(folder)))
    with pytest.raises(ValueError, match="lora_int_id=0 is invalid"):
        LoRARequest("a", 0, "/x")


@pytest.mark.parametrize("field, value, message", [
    ("max_loras", 0, "max_loras=0 is invalid: must be an integer >= 1"),
    ("max_lora_rank", 1024, "max_lora_rank=1024 is invalid: must be <= 512"),
    ("max_cpu_loras", 1, "max_cpu_loras=1 is invalid: must be >= max_loras=2"),
])
def test_engine_args_validation(field, value, message):
    from pagellm import EngineArgs

    args = EngineArgs(model="m", **{"enable_lora": True, "max_loras": 2, field: value})
    with pytest.raises(ValueError, match=message):
        args.validate()


def test_adapter_config_is_peft_format(lora_zoo):
    """The fixtures are what PEFT writes: the loader is tested on the real format."""
    _, adapters = lora_zoo
    config = json.loads((adapters["mlp-r16-patterns"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["rank_pattern"] == {"down_proj": 6}


def test_adapter_of_another_model_is_refused(lora_zoo, tmp_path):
    """An adapter trained on a deeper model, or on one of other widths, does not fit."""
    from helpers import make_tiny_model

    base, _ = lora_zoo
    llm = LLM(str(base), max_loras=1, **ENGINE_KWARGS)
    deeper = make_tiny_model(tmp_path, name="deeper", num_hidden_layers=3)
    narrower = make_tiny_model(tmp_path, name="narrower", hidden_size=32, intermediate_size=64)
    for other, message in [(deeper, "'model.layers.2.self_attn.q_proj' is not a projection"),
                           (narrower, r"the model's projection is 64 -> 64")]:
        folder = make_peft_adapter(other, tmp_path / f"{other.name}-adapter", seed=2, r=4,
                                   target_modules=["q_proj"])
        with pytest.raises(ValueError, match=message):
            llm.llm_engine.add_lora(LoRARequest(other.name, 7, str(folder)))
    assert llm.llm_engine.list_loras() == []
