"""Quality of the 8-bit KV cache and the quantized weights against the unquantized engine.

The baseline engine (the model dtype for the KV cache, weights as loaded) generates greedy
continuations of a few prompts; each variant then scores the same prompt + continuation
(teacher forcing, through prompt_logprobs): mean and max |logprob difference| of the chosen
tokens, and greedy agreement (how often the variant's own top token is the baseline's). That
scoring runs the prefill path only; each variant also generates its own greedy continuations,
one token per decode step (the decode attention kernels over its cache), and the report gives
how many leading tokens each shares with the baseline's (``generated_leading_tokens``, one per
prompt; the first comes from the prompt's prefill) and their share of all generated tokens
(``generated_agreement``): a near tie can part them early, after which nothing is compared.
Reported by benchmarks/quantization.py; tests/model/test_gguf_quantization.py holds it to
bounds loose enough for any CPU.
"""
from __future__ import annotations

import statistics

from pagellm import LLM, SamplingParams
from pagellm.model.layers import quant_matmul


def quality(model: str, prompts: int, new_tokens: int, group_size: int,
            dtype: str = "bfloat16", variants: dict[str, dict] | None = None) -> dict:
    """Score each variant's logprobs of the baseline's greedy continuations (see module)."""
    base = LLM(model, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=64 << 20)
    tokenizer = base.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):",
             "Write a short poem about the sea.", "Explain why the sky is blue.",
             "List three uses of copper:", "Once upon a time, in a small village,"][:prompts]
    prompt_ids = [tokenizer(t)["input_ids"] for t in texts]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs = base.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy, use_tqdm=False)
    continuations = [list(o.outputs[0].token_ids) for o in outs]
    full = [p + c for p, c in zip(prompt_ids, continuations)]
    reference = score(base, full, [len(p) for p in prompt_ids])
    del base
    if variants is None:
        variants = {f"kv_{d}": dict(kv_cache_dtype=d) for d in ("int8", "fp8", "fp8_e5m2")}
        variants["weights_int8"] = dict(quantization="int8")
        if quant_matmul.has_vnni_loops():  # the only builds whose int8 layers take them
            variants["weights_int8_a8"] = dict(quantization="int8", int8_activations=True)
        variants["weights_int4"] = dict(quantization="int4", quantization_group_size=group_size)
        variants["weights_int4_a8"] = dict(quantization="int4", quantization_group_size=group_size,
                                           int8_activations=True)
    report = {}
    for name, options in variants.items():
        llm = LLM(model, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=64 << 20,
                  **options)
        got = score(llm, full, [len(p) for p in prompt_ids])
        own = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy, use_tqdm=False)
        leading = [shared_prefix(c, o.outputs[0].token_ids) for c, o in zip(continuations, own)]
        diffs = [abs(a - b) for (a, _), (b, _) in zip(reference, got)]
        agree = sum(top == tok for (_, tok), (_, top) in zip(reference, got))
        report[name] = {"mean_abs_logprob_diff": round(statistics.mean(diffs), 4),
                        "max_abs_logprob_diff": round(max(diffs), 4),
                        "greedy_agreement": round(agree / len(got), 4), "tokens": len(got),
                        "generated_leading_tokens": leading,
                        "generated_agreement": round(sum(leading) / len(got), 4)}
        del llm
    return {"model": model, "prompts": len(texts), "new_tokens": new_tokens,
            "baseline": f"{dtype}, kv auto, weights as loaded", "variants": report}


def score(llm: LLM, sequences: list[list[int]], prompt_lens: list[int]
          ) -> list[tuple[float, int]]:
    """(logprob of the sequence's token, the top token) at every continuation position."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = []
    for seq, start, out in zip(sequences, prompt_lens, outs):
        for i in range(start, len(seq)):
            entries = out.prompt_logprobs[i]
            top = min(entries.items(), key=lambda kv: kv[1].rank)[0]
            result.append((entries[seq[i]].logprob, top))
    return result


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
