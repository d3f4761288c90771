"""AsyncLLMEngine: the engine behind an asyncio server.

``LLMEngine`` is not thread-safe and its ``step()`` blocks for the length of a model forward.
Running steps on the event loop would freeze every HTTP connection for that long, so one
dedicated thread, the *engine loop*, owns the engine: it alone calls ``add_request``,
``abort_request``, ``step`` and ``get_stats``. The event loop talks to it through a command
queue (adds and aborts, applied between steps, in order) and gets results back through
``loop.call_soon_threadsafe``: one callback per step carries the outputs of every request that
progressed, so many HTTP clients share each batched step (continuous batching across clients).

Each caller holds an ``OutputStream`` for its requests. Outputs are cumulative, so a stream only
keeps the newest output of each request: a slow reader never makes memory grow and never misses
the final state.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from pagellm.config import EngineArgs
from pagellm.core.engine import EngineDeadError, LLMEngine, PromptType
from pagellm.core.kv_view import MetricsHistory
from pagellm.core.stats import EngineStats
from pagellm.lora.request import LoRARequest
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pagellm")

# How often the engine loop refreshes the stats snapshot while busy; it always refreshes when
# the engine goes idle, so the snapshot seen by an idle server is exact.
STATS_REFRESH_S = 0.1
# An idle engine loop still wakes up this often, so that ``on_step`` (the periodic log line)
# sees the engine go quiet.
IDLE_TICK_S = 5.0
# A KV view (block map) younger than this is served again instead of asking the engine loop
# for a new one: however many dashboards poll, the engine builds at most 4 views a second.
KV_VIEW_MAX_AGE_S = 0.25


class EngineShuttingDown(RuntimeError):
    """The server is shutting down and takes no new requests."""


@dataclass(slots=True)
class NewRequest:
    """One request to add: the arguments of ``LLMEngine.add_request``."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


class OutputStream:
    """The outputs of a group of requests added together, for one consumer on the event loop.

    Invariants: ``pending`` holds at most one output per request (the newest, or for DELTA
    requests the merge of those not yet read); a request leaves
    ``unfinished`` exactly when its finished output is put. Only the event loop thread touches it.
    """

    def __init__(self, request_ids: Iterable[str], deltas: Iterable[str] = ()) -> None:
        self.request_ids = list(request_ids)
        self.deltas = set(deltas)  # requests whose outputs are DELTAs: merged, not replaced
        self.unfinished = set(self.request_ids)
        self.pending: dict[str, RequestOutput] = {}
        self.error: BaseException | None = None
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, output: RequestOutput) -> None:
        earlier = self.pending.get(output.request_id)
        if earlier is not None and output.request_id in self.deltas:
            output = earlier.merge(output)
        self.pending[output.request_id] = output
        if output.finished:
            self.unfinished.discard(output.request_id)
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._event.set()

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        """The requests that progressed since the last call, newest output of each."""
        while not self.pending:
            if self.error is not None:
                raise self.error
            if self.finished:
                raise StopAsyncIteration
            await self._event.wait()
            self._event.clear()
        updates = list(self.pending.values())
        self.pending.clear()
        return updates


class AsyncLLMEngine:
    """An ``LLMEngine`` driven by its own thread, with asyncio streams of outputs.

    Create it, then ``start()`` it from a running event loop. ``add_requests`` raises
    ValueError for invalid input before anything is queued (the server's HTTP 400);
    ``abort`` frees a request's KV blocks as soon as the current step ends.
    """

    def __init__(self, engine: LLMEngine,
                 on_step: Callable[[list[RequestOutput], EngineStats | None], None] | None = None
                 ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._on_step = on_step
        self._cond = threading.Condition()
        self._commands: list[tuple] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._streams: dict[str, OutputStream] = {}  # event loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: EngineStats = engine.get_stats()
        self._stats_time = 0.0
        self._history = MetricsHistory()  # engine loop thread only
        self._kv_view: dict | None = None  # event loop thread only, as the two below
        self._kv_view_time = float("-inf")
        self._kv_view_future: asyncio.Future | None = None
        self.accepting = True
        self.dead_error: BaseException | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args), **kwargs)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine loop; must be called from the event loop that will consume outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagellm-engine-loop", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort every request in flight: their streams end with
        ``finish_reason == "abort"`` so that open HTTP responses complete promptly."""
        self.accepting = False
        self.abort(list(self._streams))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the engine loop thread, then the engine's workers."""
        self.accepting = False
        with self._cond:
            self._commands.append(("abort_all",))
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self.dead_error is None

    # ------------------------------------------------------------------ requests
    async def add_requests(self, requests: list[NewRequest]) -> OutputStream:
        """Add requests as one group: all are queued, or none (ValueError for the first bad one).

        The returned stream must be released with ``release(stream)`` when the consumer stops
        reading (finished, failed or disconnected), which aborts what is still running.
        """
        self._check_accepting()
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError("request ids must be unique among requests in flight")
        stream = OutputStream(ids, [r.request_id for r in requests
                                    if r.params.output_kind is RequestOutputKind.DELTA])
        for rid in ids:
            self._streams[rid] = stream
        added: asyncio.Future = self._loop.create_future()
        self._submit(("add", requests, added))
        try:
            await added
        except BaseException:
            # Invalid input, or the caller was cancelled while the add was queued: in the
            # second case the add may still happen, so the abort (queued after it) undoes it.
            self.release(stream)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the outputs of one request as it progresses, of its params' output_kind
        (vLLM's API)."""
        stream = await self.add_requests([NewRequest(request_id, prompt, params, priority)])
        try:
            async for updates in stream:
                for output in updates:
                    yield output
        finally:
            self.release(stream)

    async def run_on_engine(self, fn: Callable, *args):
        """Call ``fn(*args)`` on the engine loop thread, between steps (the engine is not
        thread-safe): e.g. registering a LoRA adapter. Its exception is raised here."""
        self._check_accepting()
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        done: asyncio.Future = self._loop.create_future()
        self._submit(("call", fn, args, done))
        return await done

    def release(self, stream: OutputStream) -> None:
        """Forget a stream and abort its unfinished requests (no-op for finished ones)."""
        for rid in stream.request_ids:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
        if stream.unfinished:
            self.abort(list(stream.unfinished))

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests; their blocks are freed when the engine loop next gets control."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._submit(("abort", ids))

    def get_stats(self) -> EngineStats:
        """The snapshot taken by the engine loop after its latest step (exact when idle)."""
        return self._stats

    async def get_kv_view(self, timeout: float = 10.0) -> dict:
        """The block map, sequences, statistics and history (core/kv_view.py), built by the
        engine loop between two steps; a view younger than KV_VIEW_MAX_AGE_S is reused, and
        callers that ask while one is being built share it."""
        if self._loop is None:
            raise RuntimeError("AsyncLLMEngine.start() has not been called")
        if time.monotonic() - self._kv_view_time < KV_VIEW_MAX_AGE_S and self._kv_view:
            return self._kv_view
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error!r}")
        if self._kv_view_future is None or self._kv_view_future.done():
            self._kv_view_future = self._loop.create_future()
            self._submit(("kv_view", self._kv_view_future))
        view = await asyncio.wait_for(asyncio.shield(self._kv_view_future), timeout)
        self._kv_view, self._kv_view_time = view, time.monotonic()
        return view

    def num_streams(self) -> int:
        return len(self._streams)

    def _check_accepting(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead_error!r}")
        if not self.accepting:
            raise EngineShuttingDown("the server is shutting down")

    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # ------------------------------------------------------------------ engine loop thread
    def _run(self) -> None:
        try:
            while self._loop_once():
                pass
        except BaseException as exc:  # noqa: BLE001 - anything here ends the engine
            logger.exception("engine loop failed; the engine is stopped")
            self.dead_error = exc
            self._call_on_loop(self._fail_all, EngineDeadError(f"engine loop failed: {exc!r}"))

    def _loop_once(self) -> bool:
        """Apply queued commands, run one step if there is work. False ends the loop."""
        with self._cond:
            if not self._commands and not self._stopping \
                    and not self.engine.has_unfinished_requests():
                self._cond.wait(IDLE_TICK_S)
            commands, self._commands = self._commands, []
            stopping = self._stopping
        outputs: list[RequestOutput] = []
        for command in commands:
            outputs.extend(self._apply(command))
        if not stopping and self.engine.has_unfinished_requests():
            outputs.extend(self.engine.step())
        stats = self._refresh_stats()
        if outputs:
            self._call_on_loop(self._deliver, outputs)
        if self._on_step is not None:
            try:
                self._on_step(outputs, stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                logger.exception("on_step callback failed")
        return not stopping

    def _apply(self, command: tuple) -> list[RequestOutput]:
        kind = command[0]
        if kind == "abort":
            return self.engine.abort_request(command[1])
        if kind == "abort_all":
            return self.engine.abort_all()
        if kind == "call":
            _, fn, args, done = command
            try:
                result = fn(*args)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._call_on_loop(_settle, done, exc)
            else:
                self._call_on_loop(_settle, done, None, result)
            return []
        if kind == "kv_view":
            view = self.engine.get_kv_view(self._history.points())
            self._call_on_loop(_settle, command[1], None, view)
            return []
        _, requests, added = command
        done: list[str] = []
        try:
            for r in requests:
                self.engine.add_request(r.request_id, r.prompt, r.params, priority=r.priority,
                                        cache_salt=r.cache_salt, lora_request=r.lora_request)
                done.append(r.request_id)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, engine unharmed
            self.engine.abort_request(done)
            self._call_on_loop(_settle, added, exc)
            return []
        self._call_on_loop(_settle, added, None)
        return []

    def _refresh_stats(self) -> EngineStats | None:
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        if not idle and now - self._stats_time < STATS_REFRESH_S:
            return None
        self._stats = self.engine.get_stats()
        self._stats_time = now
        self._history.add(self._stats)
        return self._stats

    def _call_on_loop(self, fn: Callable, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between: nobody is listening any more
                pass

    # ------------------------------------------------------------------ event loop side
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.fail(error)
        self._streams.clear()
        if self._kv_view_future is not None:
            _settle(self._kv_view_future, error)


def _settle(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
