"""AsyncLLMEngine over a fake engine: threading, streaming, aborts, errors, shutdown."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pagellm.core.async_engine import (AsyncLLMEngine, EngineDeadError, EngineShuttingDown,
                                       NewRequest)
from pagellm.sampling_params import SamplingParams
from server_fakes import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def make(tokenizer, **kwargs) -> tuple[AsyncLLMEngine, FakeEngine]:
    fake = FakeEngine(tokenizer, **kwargs)
    return AsyncLLMEngine(fake), fake


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_generate_streams_until_finished_and_only_engine_thread_touches_engine(tokenizer):
    async def main():
        engine, fake = make(tokenizer)
        engine.start()
        outputs = [o async for o in engine.generate("hello world", SamplingParams(max_tokens=5),
                                                    "r1")]
        engine.shutdown()
        return outputs, fake

    outputs, fake = run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 5
    assert all(not o.finished for o in outputs[:-1])
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths)  # cumulative
    assert fake.thread_ids and threading.main_thread().ident not in fake.thread_ids


def test_invalid_request_raises_and_leaves_nothing(tokenizer):
    async def main():
        engine, fake = make(tokenizer, max_model_len=16)
        engine.start()
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_requests([NewRequest("r", "hi", SamplingParams(max_tokens=50))])
        assert not fake.requests and engine.num_streams() == 0
        engine.shutdown()

    run(main())


def test_group_add_is_all_or_nothing(tokenizer):
    async def main():
        engine, fake = make(tokenizer, max_model_len=16)
        engine.start()
        good = NewRequest("a", "hi", SamplingParams(max_tokens=4))
        bad = NewRequest("b", {"prompt_token_ids": []}, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_requests([good, bad])
        await asyncio.sleep(0.05)
        assert not fake.requests and engine.num_streams() == 0
        with pytest.raises(ValueError, match="unique"):
            await engine.add_requests([good, good])
        engine.shutdown()

    run(main())


def test_concurrent_requests_share_steps_and_loop_stays_responsive(tokenizer):
    async def one(engine, i):
        out = None
        async for out in engine.generate(f"prompt {i}", SamplingParams(max_tokens=8), f"r{i}"):
            pass
        return out

    async def ticker(stop: asyncio.Event) -> float:
        worst = 0.0
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t)
        return worst

    async def main():
        engine, fake = make(tokenizer, step_delay=0.25)
        engine.start()
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(stop))
        outs = await asyncio.gather(*(one(engine, i) for i in range(20)))
        stop.set()
        worst = await tick
        engine.shutdown()
        return outs, fake, worst

    outs, fake, worst = run(main())
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outs)
    assert max(fake.step_sizes) >= 10  # many clients in one batched step
    assert fake.num_steps < 20 * 8 / 2
    # the 250 ms steps run off the event loop: a loop that ran them would stall >= 250 ms
    # between ticks; 150 ms leaves room for a loaded machine's scheduling delays
    assert worst < 0.15


def test_release_mid_stream_aborts_and_frees_blocks(tokenizer):
    async def main():
        engine, fake = make(tokenizer, step_delay=0.01)
        engine.start()
        stream = await engine.add_requests([NewRequest("r", "abc", SamplingParams(max_tokens=40))])
        first = await stream.__anext__()
        assert not first[0].finished
        await wait_until(lambda: engine.get_stats().num_free_blocks < fake.num_blocks)
        engine.release(stream)
        await wait_until(lambda: not fake.requests)
        await wait_until(lambda: engine.get_stats().num_free_blocks == fake.num_blocks)
        assert engine.num_streams() == 0
        engine.shutdown()

    run(main())


def test_slow_reader_gets_newest_output_without_missing_the_end(tokenizer):
    async def main():
        engine, _ = make(tokenizer)
        engine.start()
        stream = await engine.add_requests([NewRequest("r", "abc", SamplingParams(max_tokens=30))])
        await asyncio.sleep(0.3)  # the engine finishes while nobody reads
        batches = [b async for b in stream]
        engine.release(stream)
        engine.shutdown()
        return batches

    batches = run(main())
    assert len(batches) == 1 and batches[0][0].finished
    assert len(batches[0][0].outputs[0].token_ids) == 30


def test_engine_failure_fails_streams_and_refuses_new_requests(tokenizer):
    async def main():
        engine, _ = make(tokenizer, fail_on_step=3)
        engine.start()
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("abc", SamplingParams(max_tokens=10), "r"):
                pass
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.add_requests([NewRequest("s", "abc", SamplingParams())])
        engine.shutdown()

    run(main())


def test_begin_shutdown_aborts_in_flight_and_refuses_new(tokenizer):
    async def main():
        engine, fake = make(tokenizer, step_delay=0.01)
        engine.start()
        stream = await engine.add_requests([NewRequest("r", "abc", SamplingParams(max_tokens=50))])
        await stream.__anext__()
        engine.begin_shutdown()
        last = None
        async for batch in stream:
            last = batch[-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
        with pytest.raises(EngineShuttingDown):
            await engine.add_requests([NewRequest("s", "abc", SamplingParams())])
        engine.shutdown()
        assert not fake.requests

    run(main())


def test_on_step_sees_outputs_and_stats(tokenizer):
    seen = []

    async def main():
        fake = FakeEngine(tokenizer)
        engine = AsyncLLMEngine(fake, on_step=lambda outs, stats: seen.append((outs, stats)))
        engine.start()
        async for _ in engine.generate("abc", SamplingParams(max_tokens=3), "r"):
            pass
        engine.shutdown()

    run(main())
    finished = [o for outs, _ in seen for o in outs if o.finished]
    assert [o.request_id for o in finished] == ["r"]
    assert any(stats is not None and stats.generation_tokens_total == 3 for _, stats in seen)


def test_stream_merges_delta_outputs_a_slow_consumer_missed():
    """DELTA outputs must not be dropped when the consumer falls behind: the stream joins
    them (cumulative ones simply replace each other)."""
    from pagellm.core.async_engine import OutputStream
    from pagellm.outputs import CompletionOutput, RequestOutput

    def delta(text, tokens, finish=None):
        return RequestOutput("a", None, [1, 2], None,
                             [CompletionOutput(0, text, tokens, None, None, finish)],
                             finish is not None)

    async def main():
        stream = OutputStream(["a"], deltas=["a"])
        stream.put(delta("Hel", [5]))
        stream.put(delta("lo", [6]))
        first = await stream.__anext__()
        stream.put(delta("!", [7], "stop"))
        second = await stream.__anext__()
        return first, second

    first, second = run(main())
    assert first[0].outputs[0].text == "Hello" and first[0].outputs[0].token_ids == [5, 6]
    assert second[0].outputs[0].text == "!" and second[0].finished
