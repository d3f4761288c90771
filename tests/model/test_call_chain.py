"""native.chain_calls: runs of consecutive prepared calls made by one C loop, in their order,
each kernel reading its argument structure when it runs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagellm import native
from pagellm.model.layers import cpu_ops


def norm_pipeline():
    """x -> norm -> a; a * 2 -> b (Python); b -> norm -> c; c -> norm -> d, as calls, and the
    tensors they point into (a prepared norm keeps none alive: the caller holds them)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    if not cpu_ops.available(x, "rms_norm"):
        pytest.skip(f"the compiled layer ops are off here: {native.status().get(cpu_ops.WHAT)}")
    weight = (1 + torch.randn(64, generator=gen) / 4).to(torch.bfloat16)
    a, b, c, d, e = (torch.zeros_like(x) for _ in range(5))
    scratch = torch.zeros(2 * 64 * torch.get_num_threads() + 64)
    order: list[str] = []

    def double() -> None:
        order.append("python")
        b.copy_(a * 2)

    calls = [cpu_ops.prepared_rms_norm(x, None, weight, 1e-5, a, scratch), double,
             cpu_ops.prepared_rms_norm(b, None, weight, 1e-5, c, scratch),
             cpu_ops.prepared_rms_norm(c, None, weight, 1e-5, d, scratch)]
    return calls, (a, b, c, d, e), order, (x, weight, scratch)


def test_runs_of_prepared_calls_become_one_chain_in_their_order():
    calls, (a, b, c, d, e), order, _held = norm_pipeline()
    chained = native.chain_calls(calls)
    assert native.status()["prepared call chains"].startswith("built")
    # a lone prepared call stays as it is, the Python call in its place
    assert chained[0] is calls[0] and chained[1] is calls[1] and len(chained) == 3
    assert isinstance(chained[2], native.CallChain) and chained[2].calls == tuple(calls[2:])
    for call in calls:
        call()
    want = [t.clone() for t in (a, b, c, d)]
    for t in (a, b, c, d):
        t.zero_()
    for call in chained:
        call()
    # d is the norm of c, which the chain's first call wrote: out of order it would not be
    assert all(torch.equal(t, w) for t, w in zip((a, b, c, d), want))
    assert order == ["python", "python"] and d.abs().sum() > 0
    # a field set on a chained call's arguments after the chain was made holds
    calls[3].args.out = e.data_ptr()
    d.zero_()
    chained[2]()
    assert torch.equal(e, want[3]) and not d.any()


def test_without_the_chain_s_loop_each_call_runs_on_its_own(monkeypatch):
    calls, *_held = norm_pipeline()
    monkeypatch.setattr(native, "_CHAINS", SimpleNamespace(load=lambda: None))
    assert native.chain_calls(calls) == calls
