"""Seeded benchmark workloads: which prompts are sent and how many tokens each must generate.

Every workload is a list of ``BenchRequest`` (prompt token ids and an exact output length,
enforced with ``ignore_eos`` so that runs of different systems do the same work) plus a
``WorkloadSpec`` that states how it was made, for the JSON output.

- ``random``: prompt and output lengths uniform in closed ranges; prompt tokens uniform over the
  vocabulary (special tokens excluded).
- ``sharegpt-like``: lengths drawn from log-normal distributions with the long tail of real chat
  traffic (most requests short, a few very long), clipped to the ranges; no data is downloaded.
  The medians and spreads below approximate the ShareGPT statistics vLLM's benchmarks report
  (prompts around 100-200 tokens, outputs around 100-300, heavy right tails).
- ``shared-prefix``: every prompt starts with the same system prompt of ``prefix_len`` tokens,
  followed by a random suffix; it exercises prefix caching.
- ``dataset``: the user's JSONL file, one object a line with ``prompt`` (text) or
  ``prompt_token_ids``, and optionally ``max_tokens`` (else drawn from the output range).
"""
from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("random", "sharegpt-like", "shared-prefix", "dataset")
# Log-normal (median, sigma) of the sharegpt-like prompt and output lengths, in tokens.
SHAREGPT_PROMPT_LOGNORMAL = (160.0, 1.0)
SHAREGPT_OUTPUT_LOGNORMAL = (180.0, 0.8)
# The first ids of the random model's vocabulary are <unk>, <s>, </s>: never sampled in prompts.
NUM_RESERVED_IDS = 3


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload. ``output_len`` tokens are generated, EOS or not."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class WorkloadSpec:
    """How a workload is generated; ``asdict`` of it goes into every benchmark's JSON."""

    name: str = "random"
    num_prompts: int = 64
    seed: int = 0
    input_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 256)
    prefix_len: int = 0  # shared-prefix only
    dataset: str | None = None

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} is unknown: use one of {', '.join(WORKLOADS)}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts} must be >= 1")
        for label, (low, high) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if not 1 <= low <= high:
                raise ValueError(f"{label}={low},{high} must satisfy 1 <= min <= max")
        if self.name == "dataset" and not self.dataset:
            raise ValueError("workload 'dataset' needs --dataset FILE.jsonl")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class Workload:
    spec: WorkloadSpec
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def max_len(self) -> int:
        """Longest prompt + output of any request: the KV slots the longest sequence fills."""
        return max(r.prompt_len + r.output_len for r in self.requests)

    def summary(self) -> dict[str, Any]:
        prompt = [r.prompt_len for r in self.requests]
        output = [r.output_len for r in self.requests]
        return {**self.spec.to_dict(),
                "prompt_tokens_total": sum(prompt), "output_tokens_total": sum(output),
                "prompt_len_mean": sum(prompt) / len(prompt), "prompt_len_max": max(prompt),
                "output_len_mean": sum(output) / len(output), "output_len_max": max(output)}


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(NUM_RESERVED_IDS, vocab_size) for _ in range(n)]


def _lognormal_len(rng: random.Random, median_sigma: tuple[float, float],
                   bounds: tuple[int, int]) -> int:
    median, sigma = median_sigma
    value = int(round(rng.lognormvariate(math.log(median), sigma)))
    return min(max(value, bounds[0]), bounds[1])


def random_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_prompts):
        prompt_len = rng.randint(*spec.input_len)
        output_len = rng.randint(*spec.output_len)
        requests.append(BenchRequest(_random_ids(rng, prompt_len, vocab_size), output_len))
    return requests


def sharegpt_like_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    requests = []
    for _ in range(spec.num_prompts):
        prompt_len = _lognormal_len(rng, SHAREGPT_PROMPT_LOGNORMAL, spec.input_len)
        output_len = _lognormal_len(rng, SHAREGPT_OUTPUT_LOGNORMAL, spec.output_len)
        requests.append(BenchRequest(_random_ids(rng, prompt_len, vocab_size), output_len))
    return requests


def shared_prefix_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The suffix length is drawn from ``input_len``; the prefix comes on top of it."""
    rng = random.Random(spec.seed)
    prefix = _random_ids(rng, spec.prefix_len, vocab_size)
    requests = []
    for _ in range(spec.num_prompts):
        suffix = _random_ids(rng, rng.randint(*spec.input_len), vocab_size)
        requests.append(BenchRequest(prefix + suffix, rng.randint(*spec.output_len)))
    return requests


def dataset_workload(spec: WorkloadSpec, tokenizer=None) -> list[BenchRequest]:
    """Read the first ``num_prompts`` requests of a JSONL file (fewer if the file is shorter)."""
    path = Path(spec.dataset)
    if not path.is_file():
        raise FileNotFoundError(f"dataset {str(path)!r} does not exist")
    rng = random.Random(spec.seed)
    requests = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(requests) == spec.num_prompts:
                break
            if line.strip():
                requests.append(_dataset_request(json.loads(line), line_no, spec, rng, tokenizer))
    if not requests:
        raise ValueError(f"dataset {str(path)!r} holds no requests")
    return requests


def _dataset_request(item: dict, line_no: int, spec: WorkloadSpec, rng: random.Random,
                     tokenizer) -> BenchRequest:
    text = item.get("prompt")
    ids = item.get("prompt_token_ids")
    if ids is None:
        if not isinstance(text, str):
            raise ValueError(f"{spec.dataset}:{line_no}: needs 'prompt' or 'prompt_token_ids'")
        if tokenizer is None:
            raise ValueError("a dataset of text prompts needs the model's tokenizer")
        ids = tokenizer.encode(text)
    output_len = item.get("max_tokens", item.get("output_len"))
    if output_len is None:
        output_len = rng.randint(*spec.output_len)
    if not ids or int(output_len) < 1:
        raise ValueError(f"{spec.dataset}:{line_no}: empty prompt or max_tokens < 1")
    return BenchRequest([int(t) for t in ids], int(output_len), text)


def build_workload(spec: WorkloadSpec, vocab_size: int, tokenizer=None) -> Workload:
    """Generate the requests a spec describes (identical for identical specs)."""
    if spec.name == "random":
        requests = random_workload(spec, vocab_size)
    elif spec.name == "sharegpt-like":
        requests = sharegpt_like_workload(spec, vocab_size)
    elif spec.name == "shared-prefix":
        requests = shared_prefix_workload(spec, vocab_size)
    else:
        requests = dataset_workload(spec, tokenizer)
    return Workload(spec, requests)


# ---------------------------------------------------------------------------- command line

def _len_range(text: str) -> tuple[int, int]:
    """``32,512`` -> (32, 512); ``128`` -> (128, 128)."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) == 1:
        return parts[0], parts[0]
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX or one length, got {text!r}")
    return parts[0], parts[1]


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int = 64,
                      input_len: str = "32,512", output_len: str = "16,256") -> None:
    group = parser.add_argument_group("workload (seeded; output lengths enforced with ignore_eos)")
    group.add_argument("--workload", choices=WORKLOADS, default="random",
                       help="request generator (default: random; --dataset implies dataset)")
    group.add_argument("--num-prompts", type=int, default=num_prompts)
    group.add_argument("--input-len", type=_len_range, default=_len_range(input_len),
                       metavar="MIN,MAX", help=f"prompt length range (default {input_len}); "
                       "for shared-prefix, the length after the prefix")
    group.add_argument("--output-len", type=_len_range, default=_len_range(output_len),
                       metavar="MIN,MAX", help=f"output length range (default {output_len})")
    group.add_argument("--prefix-len", type=int, default=256,
                       help="shared-prefix: tokens of the common system prompt (default 256)")
    group.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                       help="one JSON object a line: 'prompt' or 'prompt_token_ids', optional "
                            "'max_tokens'")
    group.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")


def spec_from_args(args: argparse.Namespace) -> WorkloadSpec:
    name = "dataset" if args.dataset else args.workload
    return WorkloadSpec(name=name, num_prompts=args.num_prompts, seed=args.seed,
                        input_len=tuple(args.input_len), output_len=tuple(args.output_len),
                        prefix_len=args.prefix_len if name == "shared-prefix" else 0,
                        dataset=args.dataset)
