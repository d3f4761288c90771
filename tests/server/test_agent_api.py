"""The OpenAI API as agents use it, through the official ``openai`` client against a real
``pagellm serve`` (tiny random model): structured outputs, tool calls (forced by a grammar,
parsed from the text, streamed), chat template controls, the reasoning parser, and every
request field either working or refused with a 400 naming it."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_utils import MODEL_NAME, ServerProcess, cli_env

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

KEY = "vllm-style-key"
ORIGIN = "http://dashboard.example"
# A ChatML-like template that renders tools, assistant tool calls and tool results, and a
# template variable (chat_template_kwargs).
TEMPLATE = (
    "{% if tools %}<|system|>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>\n"
    "{% endif %}{% if shout %}<|system|>\nSHOUT</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}"
    "{% if not (loop.last and continue_final_message) %}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12,
                                                  "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}' \
              '</tool_call>'


@pytest.fixture(scope="module")
def agent_server(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent")
    (folder / "template.jinja").write_text(TEMPLATE)
    env = {**cli_env(), "VLLM_API_KEY": KEY}
    proc = ServerProcess(tiny_model, folder / "serve.log", "--chat-template",
                         str(folder / "template.jinja"), "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--reasoning-parser", "think",
                         # constraints from the first token, as a random model needs them
                         # (else it may open <think> and reason until max_tokens)
                         "--structured-outputs-in-reasoning",
                         "--trust-request-chat-template", "--allowed-origins", ORIGIN,
                         "--vllm-metric-names", "--max-model-len", "1024", env=env)
    proc.wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def ac(agent_server):
    with openai.OpenAI(base_url=f"{agent_server.url}/v1", api_key=KEY, max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


def chat(ac, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 64)
    return ac.chat.completions.create(model=MODEL_NAME, **kw)


def rendered_len(tokenizer, messages, **kw) -> int:
    ids = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=True, **kw)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


# ---------------------------------------------------------------------- fields: 400 or works
def post(server, path, body, key=KEY):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("body,param", [
    ({"frobnicate": 1}, "frobnicate"),
    ({"messages": [{"role": "user", "content": "hi", "weird": 1}]}, "messages.0.weird"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": [10**7]}, "allowed_token_ids"),
    ({"metadata": {"k": 5}}, "metadata.k"),
])
def test_refused_fields_get_400_naming_them(agent_server, body, param):
    r = post(agent_server, "/v1/chat/completions",
             {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_unknown_completion_field_and_request_template_need_flags(server):
    from server_utils import API_KEY

    r = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "suffixx": "y"},
             API_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffixx"
    r = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stream": True,
                                         "prompt_logprobs": 1}, API_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    body = {"model": MODEL_NAME, "messages": ASK, "max_tokens": 4}
    r = post(server, "/v1/chat/completions", {**body, "chat_template": "{{ 'x' }}"}, API_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    r = post(server, "/v1/chat/completions", {**body, "tools": TOOLS}, API_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"  # no parser


def test_metadata_fields_accepted(ac):
    out = chat(ac, max_tokens=4, user="u1", metadata={"team": "a"}, store=False,
               service_tier="auto")
    assert out.choices[0].message.role == "assistant"
    assert out.system_fingerprint and out.system_fingerprint.startswith("fp_")


def test_sampling_fields_work(ac, hf_tokenizer):
    (a,) = hf_tokenizer.encode("a", add_special_tokens=False)
    out = ac.completions.create(model=MODEL_NAME, prompt="x", max_tokens=5, temperature=1.0,
                                extra_body={"allowed_token_ids": [a], "ignore_eos": True})
    assert out.choices[0].text == "aaaaa"
    (b,) = hf_tokenizer.encode("b", add_special_tokens=False)
    out = ac.completions.create(model=MODEL_NAME, prompt="x", max_tokens=8, temperature=100.0,
                                seed=1, extra_body={"allowed_token_ids": [a, b],
                                                    "bad_words": ["a"], "ignore_eos": True})
    assert out.choices[0].text == "b" * 8
    out = ac.completions.create(model=MODEL_NAME, prompt="x", max_tokens=6, temperature=1.0,
                                seed=3, logit_bias={str(b): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "b" * 6
    prompt = "The quick brown fox jumps over the lazy dog"
    n = len(hf_tokenizer.encode(prompt))
    out = ac.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                extra_body={"truncate_prompt_tokens": 3, "prompt_logprobs": 2})
    assert out.usage.prompt_tokens == 3 < n
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 3
    assert all(1 <= len(e) <= 3 for e in entries[1:])
    out = chat(ac, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert len(out.model_extra["prompt_logprobs"]) == out.usage.prompt_tokens


def test_continuous_usage_stats(ac):
    chunks = list(chat(ac, max_tokens=6, stream=True, extra_body={"ignore_eos": True},
                       stream_options={"include_usage": True,
                                       "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6


def test_chat_template_controls(ac, hf_tokenizer):
    base = chat(ac, max_tokens=1).usage.prompt_tokens
    assert base == rendered_len(hf_tokenizer, ASK, add_generation_prompt=True)
    shout = chat(ac, max_tokens=1, extra_body={"chat_template_kwargs": {"shout": True}})
    assert shout.usage.prompt_tokens == rendered_len(hf_tokenizer, ASK, shout=True,
                                                     add_generation_prompt=True) > base
    partial = ASK + [{"role": "assistant", "content": "The weather is"}]
    cont = chat(ac, messages=partial, max_tokens=1,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert cont.usage.prompt_tokens == rendered_len(hf_tokenizer, partial,
                                                    continue_final_message=True)
    no_prompt = chat(ac, max_tokens=1, extra_body={"add_generation_prompt": False})
    assert no_prompt.usage.prompt_tokens == rendered_len(hf_tokenizer, ASK)
    own = chat(ac, max_tokens=1, extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    assert own.usage.prompt_tokens == len(hf_tokenizer.encode(ASK[0]["content"]))


# ---------------------------------------------------------------------- structured outputs
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "number", "string", "enum", "boolean", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -5.0, "maximum": rng.choice([1.5, 10.0, 1e3])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, None, True], 3)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "maxItems": rng.randint(1, 3)}
    props = {f"k{i}": random_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "required": sorted(props),
            "additionalProperties": False}


def test_json_schema_outputs_validate_for_20_random_schemas(ac):
    rng = random.Random(0)
    schemas = [{"type": "object", "properties": {"answer": random_schema(rng),
                                                 "items": random_schema(rng)},
                "required": ["answer", "items"], "additionalProperties": False}
               for _ in range(20)]

    def ask(i_schema):
        i, schema = i_schema
        return chat(ac, max_tokens=400, temperature=1.0, seed=i, response_format={
            "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})

    with ThreadPoolExecutor(8) as pool:  # one batch: constrained rows side by side
        outs = list(pool.map(ask, enumerate(schemas)))
    for schema, out in zip(schemas, outs):
        assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_json_object(ac):
    for seed in range(3):
        choice = chat(ac, max_tokens=300, temperature=1.0, seed=seed,
                      response_format={"type": "json_object"}).choices[0]
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":  # any object: a random model may write a long one
            assert isinstance(json.loads(text), dict)


def test_batch_mixing_constrained_and_unconstrained(ac):
    plain = dict(messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=24,
                 temperature=0.0, extra_body={"ignore_eos": True})
    alone = chat(ac, **plain).choices[0].message.content
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                    "maximum": 9}},
             "required": ["n"], "additionalProperties": False}
    kinds = [dict(response_format={"type": "json_schema",
                                   "json_schema": {"name": "n", "schema": small}}),
             dict(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}),
             dict(extra_body={"guided_regex": "[0-9]{4}"}),
             dict(extra_body={"guided_choice": ["left", "right"]}), plain, plain]
    with ThreadPoolExecutor(len(kinds)) as pool:
        outs = list(pool.map(lambda kw: chat(ac, **kw), kinds))
    texts = [o.choices[0].message.content for o in outs]
    assert json.loads(texts[0])["n"] in range(10)
    assert texts[1] in ("yes", "no") and texts[3] in ("left", "right")
    assert len(texts[2]) == 4 and texts[2].isdigit()
    assert texts[4] == texts[5] == alone


# ---------------------------------------------------------------------- tool calls
def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_tool_choice_required_always_gives_valid_calls(ac):
    def ask(seed):
        return chat(ac, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                    max_tokens=200)

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(ask, range(6)))
    for out in outs:
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
    single = chat(ac, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
                  parallel_tool_calls=False, max_tokens=200)
    assert len(single.choices[0].message.tool_calls) == 1


def test_named_tool_choice(ac):
    out = chat(ac, tools=TOOLS, temperature=1.0, seed=2, max_tokens=200,
               tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "stop"
    check_call(call)


def test_tool_call_round_trip(ac, hf_tokenizer):
    first = chat(ac, tools=TOOLS, tool_choice="required", temperature=1.0, seed=5,
                 parallel_tool_calls=False, max_tokens=200)
    message = first.choices[0].message
    (call,) = message.tool_calls
    check_call(call)
    history = ASK + [message, {"role": "tool", "tool_call_id": call.id,
                               "content": '{"temperature": 21}'}]
    final = chat(ac, messages=history, tools=TOOLS, tool_choice="none", max_tokens=16,
                 temperature=0.0, extra_body={"ignore_eos": True})
    assert final.choices[0].finish_reason == "length"
    assert isinstance(final.choices[0].message.content, str)
    assert not final.choices[0].message.tool_calls
    # the template saw the assistant's call and the tool's answer (tools: none hides tools)
    local = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    assert final.usage.prompt_tokens == rendered_len(hf_tokenizer, local,
                                                     add_generation_prompt=True)


def streamed_calls(chunks) -> tuple[dict[int, dict], list]:
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            finishes.append(choice.finish_reason)
            for piece in choice.delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"id": None, "name": None, "args": ""})
                if piece.id:
                    assert call["id"] is None  # id and name come once, first
                    call["id"], call["name"] = piece.id, piece.function.name
                call["args"] += piece.function.arguments or ""
    return calls, finishes


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_equal_non_streamed(ac, tool_choice):
    kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=9, max_tokens=200)
    whole = chat(ac, **kw).choices[0].message.tool_calls
    chunks = list(chat(ac, stream=True, **kw))
    calls, finishes = streamed_calls(chunks)
    assert [(c["name"], c["args"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert sum(1 for c in chunks for ch in c.choices if ch.delta.tool_calls) > 2  # pieces
    assert finishes[-1] == ("tool_calls" if tool_choice == "required" else "stop")


def test_hermes_parser_in_auto_mode_streaming_or_not(ac):
    # the regex makes the random model write a Hermes call after some content
    kw = dict(tools=TOOLS, tool_choice="auto", max_tokens=100, temperature=1.0, seed=1,
              extra_body={"guided_regex": "Sure[.] " + HERMES_CALL.replace("{", r"\{")
                          .replace("}", r"\}")})
    out = chat(ac, **kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Sure."
    (call,) = out.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris", "unit": "c"})
    chunks = list(chat(ac, stream=True, **kw))
    calls, finishes = streamed_calls(chunks)
    content = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert content.strip() == "Sure."
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris", "unit": "c"})]
    assert finishes[-1] == "tool_calls"


def test_reasoning_parser_splits_think(ac):
    kw = dict(max_tokens=60, extra_body={"guided_regex": "<think>abc def</think>Paris"})
    message = chat(ac, **kw).choices[0].message
    assert message.model_extra["reasoning_content"] == "abc def"
    assert message.content == "Paris"
    chunks = list(chat(ac, stream=True, **kw))
    deltas = [ch.delta for c in chunks for ch in c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "abc def"
    assert "".join(d.content or "" for d in deltas) == "Paris"


def test_constraints_cover_the_reasoning_with_the_flag(ac, hf_tokenizer):
    """tests/server/test_reasoning_constraints.py's request: without the flag the model opens
    <think>; with it, the choice holds from the first token."""
    from test_reasoning_constraints import CHOICE, steered_to_reasoning

    message = chat(ac, max_tokens=12, temperature=0.0, extra_body=CHOICE,
                   logit_bias=steered_to_reasoning(hf_tokenizer)).choices[0].message
    assert message.content in ("yes", "no")
    assert message.model_extra.get("reasoning_content") is None


# ---------------------------------------------------------------------- usage and routes
def test_cached_tokens_version_embeddings_cors_metrics(ac, agent_server):
    long_ask = [{"role": "user", "content": "Explain paged attention. " * 20}]
    chat(ac, messages=long_ask, max_tokens=1)
    again = chat(ac, messages=long_ask, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{agent_server.url}/version", headers=auth).json()["version"]
    r = httpx.post(f"{agent_server.url}/v1/embeddings", headers=auth,
                   json={"model": MODEL_NAME, "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_supported"
    with pytest.raises(openai.NotFoundError):
        ac.embeddings.create(model=MODEL_NAME, input="x")
    pre = httpx.options(f"{agent_server.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    metrics = httpx.get(f"{agent_server.url}/metrics", headers=auth).text
    assert 'vllm:prompt_tokens_total{engine="0",model_name=' in metrics
    assert "pagellm:prompt_tokens_total" in metrics
    assert httpx.get(f"{agent_server.url}/version").status_code == 401  # VLLM_API_KEY


def test_vllm_flag_spellings():
    import argparse

    from pagellm.entrypoints.commands import serve
    from pagellm.entrypoints.commands.engine_flags import engine_args_from

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "m", "-tp", "1", "--max-model-len", "32k",
                              "--max-num-batched-tokens", "2K", "--dtype", "half",
                              "--trust-remote-code", "--enforce-eager"])
    engine_args = engine_args_from(args)
    assert (engine_args.tensor_parallel_size, engine_args.max_model_len,
            engine_args.max_num_batched_tokens, engine_args.dtype) == (1, 32000, 2048, "float16")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--max-model-len", "1.5x"])
