"""Sampler: greedy, logprobs, truncation masks, penalties, seeds and min_tokens, each checked
against a plain reference written with Python loops."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pagellm.sampling_params import SamplingParams
from pagellm.worker.random_sampling import apply_top_k_top_p
from pagellm.worker.sampler import Sampler, SamplingMetadata, _apply_penalties, compute_logprobs

VOCAB = 50
EOS = 7


def make_meta(params: list[SamplingParams], prompts=None, outputs=None, generators=None):
    n = len(params)
    return SamplingMetadata(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[1, 2, 3]] * n,
        output_token_ids=outputs if outputs is not None else [[]] * n,
        generators=generators if generators is not None else [None] * n,
    )


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# ---- reference implementations (one row, plain Python) -------------------------------------

def reference_penalties(row: list[float], p: SamplingParams, prompt: list[int],
                        output: list[int]) -> list[float]:
    row = list(row)
    seen = set(prompt) | set(output)
    for t in range(len(row)):
        if t in seen:
            if row[t] > 0:
                row[t] /= p.repetition_penalty
            else:
                row[t] *= p.repetition_penalty
        count = output.count(t)
        row[t] -= p.frequency_penalty * count
        if count:
            row[t] -= p.presence_penalty
    return row


def reference_allowed(row: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    """Tokens that survive top-k, then top-p, then min-p (ties at a cut-off survive)."""
    order = sorted(range(len(row)), key=lambda t: -row[t])
    kept = order[:top_k] if top_k > 0 else order
    kth = row[kept[-1]]
    kept = [t for t in order if row[t] >= kth]
    z = sum(math.exp(row[t]) for t in kept)
    if top_p < 1.0:
        mass, prefix = 0.0, []
        for t in kept:
            prefix.append(t)
            mass += math.exp(row[t]) / z
            if mass >= top_p:
                break
        kept = [t for t in kept if row[t] >= row[prefix[-1]]]
    best = max(row[t] for t in kept)
    return {t for t in kept if math.exp(row[t] - best) >= min_p}


# ---- greedy and logprobs ---------------------------------------------------------------------

def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(6)
    original = logits.clone()
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in (None, 0, 1, 3, 5, 20)]
    out = Sampler(VOCAB, EOS)(logits, make_meta(params))
    assert torch.equal(logits, original), "the caller's logits must not be modified"
    assert out.token_ids == logits.argmax(-1).tolist()
    log_softmax = torch.log_softmax(logits, -1)
    expected = log_softmax.gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
    assert out.ranks == [1] * 6
    assert out.top_logprobs[0] is None and out.top_logprobs[1] == []
    for i, p in enumerate(params[2:], start=2):
        values, indices = log_softmax[i].topk(p.logprobs)
        assert [t for t, _ in out.top_logprobs[i]] == indices.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)


def test_logprobs_ignore_penalties_and_temperature_and_ranks_are_counted() -> None:
    logits = random_logits(4, seed=1)
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=2),
              SamplingParams(temperature=0.0, presence_penalty=1.5, logprobs=2),
              SamplingParams(temperature=2.0, top_k=10, logprobs=2),
              SamplingParams(temperature=1.0, min_tokens=3, logprobs=2)]
    outputs = [[5, 5, 9], list(range(0, VOCAB, 2)), [1], []]
    torch.manual_seed(0)
    out = Sampler(VOCAB, EOS)(logits, make_meta(params, outputs=outputs))
    log_softmax = torch.log_softmax(logits, -1)
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(log_softmax[i, token].item(), abs=1e-5)
        assert out.ranks[i] == 1 + int((log_softmax[i] > log_softmax[i, token]).sum())
        assert [t for t, _ in out.top_logprobs[i]] == log_softmax[i].topk(2).indices.tolist()


def test_compute_logprobs_for_given_tokens() -> None:
    logits = random_logits(5, seed=2)
    tokens = torch.tensor([0, 3, 49, 10, 10])
    out = compute_logprobs(logits, tokens, [None, 1, None, 4, 0])
    log_softmax = torch.log_softmax(logits, -1)
    assert out.token_ids == tokens.tolist()
    assert out.logprobs == pytest.approx(log_softmax.gather(1, tokens[:, None]).squeeze(1).tolist(),
                                         abs=1e-5)
    assert out.top_logprobs[0] is None and out.top_logprobs[4] == []
    assert len(out.top_logprobs[3]) == 4


@pytest.mark.parametrize("kept_storage", [False, True])
def test_compute_logprobs_is_logsumexp_exactly_with_inf_rows_and_ties(kept_storage: bool) -> None:
    logits = random_logits(6, seed=3) * 8
    logits[1, 10:] = -math.inf  # a row masked down to ten tokens
    logits[2, :] = -math.inf  # every token masked: logprob -inf (or nan), as torch gives
    logits[3, :7] = logits[3].max()  # a seven-way tie at the top
    logits[4, 5] = math.inf
    tokens = torch.tensor([0, 9, 4, 6, 5, 11])
    work = torch.full_like(logits, 123.0) if kept_storage else None
    out = compute_logprobs(logits, tokens, [2, None, None, 7, 0, 3], work=work)
    lse = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(1, tokens[:, None]).squeeze(1)
    expected = (chosen - lse).tolist()
    for got, want in zip(out.logprobs, expected):
        assert got == want or (math.isnan(got) and math.isnan(want))
    assert out.ranks == (1 + (logits > chosen[:, None]).sum(-1)).tolist()
    assert out.ranks[3] == 1 and out.ranks[1] > 1
    values, indices = logits.topk(7, dim=-1)
    for i, k in [(0, 2), (3, 7), (5, 3)]:
        assert out.top_logprobs[i] == list(zip(indices[i, :k].tolist(),
                                               (values[i, :k] - lse[i]).tolist()))


def test_all_greedy_batch_without_penalties_is_argmax_and_logsumexp_only() -> None:
    class RecordOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    logits = random_logits(8)
    heavy = {"clone", "sort", "topk", "softmax", "_softmax", "_log_softmax", "cumsum",
             "uniform", "searchsorted", "gt", "sum", "index", "bincount"}
    with RecordOps() as recorder:
        out = Sampler(VOCAB, EOS)(logits, make_meta([SamplingParams(temperature=0.0)] * 8))
    assert "argmax" in recorder.ops and not {"logsumexp", "exp", "exp_"} & set(recorder.ops)
    assert not heavy & set(recorder.ops), recorder.ops
    assert out.logprobs is None and out.ranks is None
    with RecordOps() as recorder:
        Sampler(VOCAB, EOS)(logits, make_meta([SamplingParams(temperature=0.0, logprobs=0)] * 8))
    # the logsumexp (max, exp, sum, log) and nothing else over the vocabulary: no rank count
    assert "argmax" in recorder.ops and "exp_" in recorder.ops
    assert not (heavy - {"sum"}) & set(recorder.ops), recorder.ops


def test_padded_vocabulary_columns_are_never_sampled() -> None:
    logits = torch.zeros(3, VOCAB + 14)
    logits[:, VOCAB:] = 100.0
    params = [SamplingParams(temperature=0.0, logprobs=0), SamplingParams(),
              SamplingParams(top_p=0.5)]
    out = Sampler(VOCAB, EOS)(logits, make_meta(params))
    assert all(t < VOCAB for t in out.token_ids)
    assert out.logprobs[0] == pytest.approx(-math.log(VOCAB), abs=1e-5)


# ---- truncation masks ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_mask_matches_reference(seed: int) -> None:
    logits = random_logits(8, seed=seed)
    logits[0, 3] = logits[0, 4] = logits[0].max() + 1  # a tie at the top
    logits[1, :10] = 0.25  # a tie at a cut-off
    top_k = [0, 3, 1, 10, 0, VOCAB + 5, 2, 7]
    top_p = [0.3, 1.0, 0.5, 0.9, 0.99, 0.6, 1.0, 1e-6]
    probs = logits.softmax(dim=-1)
    masked = apply_top_k_top_p(probs.clone(), top_k, top_p)
    for i in range(8):
        allowed = reference_allowed(logits[i].tolist(), top_k[i], top_p[i], 0.0)
        assert set(masked[i].nonzero().flatten().tolist()) == allowed, i
        assert torch.equal(masked[i][list(allowed)], probs[i][list(allowed)])


def test_top_p_finds_wide_nuclei() -> None:
    """Nuclei wider than the first windows searched (64, 512, then 4096 tokens) still cut
    right."""
    vocab = 6000
    logits = random_logits(5, vocab=vocab, seed=9, scale=0.05)  # nearly flat: a huge nucleus
    logits[1] = random_logits(1, vocab=vocab, seed=10, scale=4.0)[0]  # a peaked row
    logits[2, :5] = 20.0  # a nucleus of five tied tokens
    top_p = [0.9, 0.95, 0.5, 0.2, 0.04]
    masked = apply_top_k_top_p(logits.softmax(dim=-1), [0] * 5, top_p)
    sizes = []
    for i in range(5):
        allowed = reference_allowed(logits[i].tolist(), 0, top_p[i], 0.0)
        assert set(masked[i].nonzero().flatten().tolist()) == allowed, i
        sizes.append(len(allowed))
    # One row resolved in each window: the top 64, 512 and 4096, and the full sort.
    assert sizes[1] < 64 and 64 < sizes[4] < 512 and 512 < sizes[3] < 4096, sizes
    assert sizes[0] > 4096 and sizes[2] == 5, sizes


def empirical(logits_row: torch.Tensor, p: SamplingParams, draws: int = 4000) -> torch.Tensor:
    torch.manual_seed(1234)
    logits = logits_row.expand(draws, -1).clone()
    out = Sampler(logits.shape[1], None)(logits, make_meta([p] * draws))
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[1]) / draws


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5),
     SamplingParams(temperature=1.5, top_k=3), SamplingParams(top_p=0.7),
     SamplingParams(top_k=4, top_p=0.8, temperature=0.8), SamplingParams(min_p=0.2)],
)
def test_sampling_frequencies_follow_the_truncated_distribution(params: SamplingParams) -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
    scaled = (row / params.temperature).tolist()
    allowed = reference_allowed(scaled, params.top_k, params.top_p, params.min_p)
    expected = torch.zeros(len(row))
    index = torch.tensor(sorted(allowed))
    expected[index] = torch.softmax(torch.tensor(scaled)[index], -1)
    freq = empirical(row, params)
    assert set(freq.nonzero().flatten().tolist()) <= allowed
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


@pytest.mark.parametrize("vocab", [300, 1000, 1024])  # one level; two, with a short last block
def test_inverse_cdf_draw_is_the_float64_one(vocab: int) -> None:
    """Each row's token is the first whose cumulative weight (in float64) exceeds the row's
    uniform number times its total, up to float32 rounding at a boundary; a token of weight 0
    is never drawn, and a row with nothing to draw (all zero, NaN) gets -1 for the repair."""
    from pagellm.worker.random_sampling import _inverse_cdf_sample

    gen = torch.Generator().manual_seed(vocab)
    rows = 64
    weights = torch.rand(rows, vocab, generator=gen) ** 8
    weights[weights < 0.05] = 0.0  # most tokens banned
    weights[1, :200] = 0.0  # whole blocks of zeros
    weights[2, :-1], weights[2, -1] = 0.0, 0.5  # only the last token
    weights[3, 5] = 1e6  # one token dominates
    weights[4] = 0.0  # nothing to draw
    weights[5, 7] = float("nan")
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    uniform = [torch.rand(1, generator=torch.Generator().manual_seed(i)).item()
               for i in range(rows)]
    ids = _inverse_cdf_sample(weights.clone(), generators).tolist()
    assert ids[4] == -1 and ids[5] == -1
    assert ids[2] == vocab - 1 and ids[3] == 5
    cdf = weights.double().cumsum(dim=-1)
    for i in set(range(rows)) - {4, 5}:
        target, total = uniform[i] * cdf[i, -1].item(), cdf[i, -1].item()
        j = ids[i]
        assert 0 <= j < vocab and weights[i, j] > 0, (i, j)
        low = cdf[i, j - 1].item() if j else 0.0
        assert low - 1e-5 * total <= target <= cdf[i, j].item() + 1e-5 * total, (i, j)


def test_sampling_frequencies_over_a_wide_vocabulary() -> None:
    """The two-level draw over 1000 tokens (blocks of 128 and a short last one) follows the
    softmax, with mass in several blocks, at a block's edges and in the last block."""
    row = torch.full((1000,), -math.inf)
    picks = {0: 1.0, 127: 0.5, 128: 0.0, 500: 1.5, 895: -0.5, 896: 0.2, 999: 0.8}
    for token, logit in picks.items():
        row[token] = logit
    expected = torch.softmax(row, -1)
    freq = empirical(row, SamplingParams(temperature=1.0), draws=6000)
    assert set(freq.nonzero().flatten().tolist()) <= set(picks)
    assert (freq - expected).abs().max() < 0.03, (freq[list(picks)], expected[list(picks)])


# ---- penalties ---------------------------------------------------------------------------------

def test_penalties_match_reference_loop() -> None:
    logits = random_logits(5, seed=3)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.5,
                             presence_penalty=-1.0),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    prompts = [[1, 2, 2, 40], [3, 4], [5, 6, 7, 8, 9], [], []]
    outputs = [[2, 11, 11], [4, 4, 4, 12], [6, 13, 13, 13, 49], [0], []]
    got = logits.clone()
    _apply_penalties(got, torch.arange(5), params, prompts, outputs)
    for i, p in enumerate(params):
        want = reference_penalties(logits[i].tolist(), p, prompts[i], outputs[i])
        assert got[i].tolist() == pytest.approx(want, abs=1e-5), i
    # on chosen rows of a larger batch (the others untouched)
    wide = torch.cat([logits, random_logits(3, seed=4)])[[5, 0, 6, 1, 2, 7, 3, 4]]
    before = wide.clone()
    _apply_penalties(wide, torch.tensor([1, 3, 4, 6, 7]), params, prompts, outputs)
    assert torch.equal(wide[[1, 3, 4, 6, 7]], got)
    assert torch.equal(wide[[0, 2, 5]], before[[0, 2, 5]])
    # And the sampler uses them: greedy picks the argmax of the penalised logits.
    out = Sampler(VOCAB, EOS)(logits, make_meta(params, prompts, outputs))
    assert out.token_ids == got.argmax(-1).tolist()


def test_one_sampler_over_many_steps_equals_fresh_ones() -> None:
    """The sampler keeps its processed copy of the logits from call to call: steps of
    different sizes, with penalties, logprobs and random rows, give what a fresh sampler gives,
    and never touch the logits passed in."""
    sampler = Sampler(VOCAB, EOS)
    for step, rows in enumerate([6, 2, 9, 1, 9, 4]):
        logits = random_logits(rows, seed=10 + step)
        given = logits.clone()
        params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, logprobs=2,
                                 presence_penalty=0.5 * (i % 3), repetition_penalty=1.2)
                  for i in range(rows)]
        outputs = [[i, i + 1, 7] for i in range(rows)]

        def meta():
            return SamplingMetadata(params, [[3, 4]] * rows, outputs, [
                torch.Generator().manual_seed(100 * step + i) for i in range(rows)])

        got, want = sampler(logits, meta()), Sampler(VOCAB, EOS)(logits, meta())
        assert (got.token_ids, got.logprobs, got.top_logprobs) == \
            (want.token_ids, want.logprobs, want.top_logprobs)
        assert torch.equal(logits, given)


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.5
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert Sampler(VOCAB, None)(logits, make_meta(params, [[]], [[]])).token_ids == [5]
    assert Sampler(VOCAB, None)(logits, make_meta(params, [[5]], [[]])).token_ids == [6]
    assert Sampler(VOCAB, None)(logits, make_meta(params, [[]], [[5]])).token_ids == [6]


# ---- seeds and min_tokens ----------------------------------------------------------------------

def seeded_run(batch_size: int, position: int, steps: int = 6) -> list[int]:
    """Samples `steps` tokens for one seeded request placed among other requests."""
    sampler = Sampler(VOCAB, EOS)
    target = SamplingParams(temperature=0.9, top_p=0.9, seed=42)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5),
              SamplingParams(temperature=1.3, seed=7, presence_penalty=0.5),
              SamplingParams(min_p=0.1), SamplingParams(top_p=0.5)]
    generator = torch.Generator().manual_seed(target.seed)
    other_generators = [torch.Generator().manual_seed(7) if p.seed else None for p in others]
    history: list[int] = []
    for step in range(steps):
        logits = random_logits(batch_size, seed=100 + step + 10 * batch_size)
        logits[position] = random_logits(1, seed=step)[0]
        params = [others[i % len(others)] for i in range(batch_size)]
        generators = [other_generators[i % len(others)] for i in range(batch_size)]
        params[position], generators[position] = target, generator
        outputs = [[3] * i for i in range(batch_size)]
        outputs[position] = history
        out = sampler(logits, make_meta(params, outputs=outputs, generators=generators))
        history = history + [out.token_ids[position]]
    return history


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(0)
    alone = seeded_run(1, 0)
    assert len(set(alone)) > 1, "a test on a single repeated token proves little"
    torch.manual_seed(1)
    assert seeded_run(5, 2) == alone
    torch.manual_seed(2)
    assert seeded_run(9, 8) == alone


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 20] = 9.0
    logits[:, 30] = 8.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, logprobs=0),
              SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[20]),
              SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, min_tokens=3)]
    outputs = [[1, 2], [1], [], [1, 2, 3]]
    out = Sampler(VOCAB, EOS)(logits, make_meta(params, outputs=outputs))
    assert out.token_ids == [20, 30, EOS, EOS]
    # The reported logprob is still the raw one: EOS was the most likely token.
    assert out.ranks[0] == 2


def test_min_tokens_holds_for_random_rows() -> None:
    logits = torch.zeros(200, VOCAB)
    logits[:, EOS] = 5.0
    params = [SamplingParams(min_tokens=1)] * 200
    torch.manual_seed(0)
    out = Sampler(VOCAB, EOS)(logits, make_meta(params))
    assert EOS not in out.token_ids


def test_greedy_argmax_is_torchs_argmax():
    """greedy_argmax picks what torch.argmax picks: the first maximum, NaN as the maximum, at
    widths that are and are not multiples of the two levels' block, for 9 rows (two levels),
    for one and for three (torch.max), row-major and column-major."""
    from pagellm.worker.sampler import greedy_argmax

    gen = torch.Generator().manual_seed(0)
    for vocab in (512, 1000, 32000, 49152):
        x = torch.randn(9, vocab, generator=gen)  # 9 rows: the two-level path
        x[1, 3] = x[1, 700 % vocab] = 1e6  # a tie: the first wins
        x[2, -1] = 1e6  # the maximum in the padded last block
        x[3] = -math.inf  # every token banned
        x[4, 17] = float("nan")
        x[5, :] = 0.0
        x[6, 5] = x[6, -2] = float("nan")  # the first NaN wins
        assert torch.equal(greedy_argmax(x), x.argmax(dim=-1)), vocab
        for row in range(9):  # one row at a time
            assert torch.equal(greedy_argmax(x[row:row + 1]), x[row:row + 1].argmax(dim=-1))
        for start in (0, 3, 6):  # three rows at a time, row-major and column-major
            rows = x[start:start + 3]
            assert torch.equal(greedy_argmax(rows), rows.argmax(dim=-1))
            assert torch.equal(greedy_argmax(rows.t().contiguous().t()), rows.argmax(dim=-1))
        # Column-major, as the CPU's float32 GEMM writes the vocabulary projection, and a
        # slice of a padded one: the same picks.
        columns = x.t().contiguous().t()
        assert columns.stride() == (1, 9)
        assert torch.equal(greedy_argmax(columns), x.argmax(dim=-1)), vocab
        padded = torch.full((vocab + 7, 9), -math.inf)
        padded[:vocab] = x.t()
        assert torch.equal(greedy_argmax(padded.t()[:, :vocab]), x.argmax(dim=-1)), vocab


def test_column_major_logits_sample_as_row_major_ones() -> None:
    """Every kind of row gives the same tokens and logprobs from column-major logits (the
    float32 GEMM's transposed output) as from the same values laid out by rows, and the
    logits passed in stay untouched."""
    rows, vocab = 12, 1000
    logits = random_logits(rows, vocab, seed=4)
    columns = logits.t().contiguous().t()
    kinds = [dict(temperature=0.0), dict(temperature=0.0, logprobs=3),
             dict(temperature=0.9, top_p=0.8, seed=1), dict(temperature=0.7, top_k=20, seed=2),
             dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4),
             dict(temperature=1.0, min_p=0.05, seed=3, logprobs=0)]
    for kind in kinds:
        for mixed in (False, True):  # all rows of the kind, or alternating with greedy rows
            params = [SamplingParams(**kind) if not mixed or i % 2 else SamplingParams(
                temperature=0.0) for i in range(rows)]
            outputs = [[i, 2 * i, 9] for i in range(rows)]

            def meta():
                return make_meta(params, [[3, 4]] * rows, outputs,
                                 [torch.Generator().manual_seed(7 + i) for i in range(rows)])

            sampler, given = Sampler(vocab, EOS), columns.clone()
            for _ in range(2):  # the second call reuses the sampler's copies
                got, want = sampler(columns, meta()), Sampler(vocab, EOS)(logits, meta())
                assert (got.token_ids, got.logprobs, got.ranks, got.top_logprobs) == \
                    (want.token_ids, want.logprobs, want.ranks, want.top_logprobs), kind
            assert torch.equal(columns, given) and columns.stride() == (1, rows)
