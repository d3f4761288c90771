"""The multiprocessing executor: tensor-parallel ranks 1..N-1 as worker processes on this
host, rank 0 in the driver (the engine's own process), as vLLM's ``mp`` backend.

The driver owns the scheduler and the KV cache manager; each step it sends the plan
(``SchedulerOutput`` without the sampling parameters, which only rank 0 reads) to every
worker through a pipe, runs its own shard of the step, and waits for each worker's
acknowledgement. The ranks exchange activations through torch.distributed (gloo on the CPU,
NCCL on GPUs), never through the pipes.

Failures: a watchdog thread waits on the workers' process sentinels; when one dies it kills
the others (which also breaks a collective the driver may be blocked in, since its peers are
gone) and the step raises ``WorkerDiedError``, an ``EngineDeadError``. A step that fails on
every rank (the same plan fails the same way everywhere) fails like a single-device step; one
that fails on some ranks only leaves the ranks out of step, so it is the engine's end too: a
worker that failed while the driver is still blocked in the step is noticed by the watchdog
(the worker's ``failed`` event) within ``STRAGGLER_GRACE_S``. A worker polls its parent's pid
and exits when the driver is gone, or when its pipe closes.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
import traceback
import weakref
from typing import Any

import torch

from pagellm.core.engine import EngineDeadError
from pagellm.core.plan import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.parallel_state import (TensorParallelGroup, destroy_distributed,
                                                free_port, init_distributed)

logger = logging.getLogger("pagellm")

# Seconds a collective or a step may wait for the other ranks before it fails (a hung, not
# dead, rank); and for the workers to load their shards at start-up.
TIMEOUT_S = float(os.environ.get("PAGELLM_TP_TIMEOUT_S", "600"))
# How often a worker checks that its driver is still alive while it waits for a plan.
PARENT_POLL_S = 0.5
# A rank that failed a step alone leaves the others blocked in a collective: after this many
# seconds of a failed rank and a driver still inside the step, the step is declared lost.
STRAGGLER_GRACE_S = 5.0


class WorkerDiedError(EngineDeadError):
    """A tensor-parallel worker exited or stopped answering, or the ranks fell out of step:
    the engine cannot go on."""


class WorkerStepError(RuntimeError):
    """What the workers reported about the step that ended the engine (the cause)."""


def make_executor(spec: Any, device: torch.device) -> tuple[Any, Any]:
    """(executor, the driver's RankWorker) for ``spec.args.distributed_executor_backend``."""
    if spec.args.distributed_executor_backend == "ray":
        from pagellm.distributed.ray_executor import RayExecutor

        executor = RayExecutor(spec, device)
    else:
        executor = MultiprocExecutor(spec, device)
    return executor, executor.driver


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def start_driver_thread(world_size: int, spec: Any, device: torch.device, init_method: str,
                        build) -> tuple[threading.Thread, dict[str, Any]]:
    """Join the group as rank 0 and build its worker in a started helper thread, so that the
    caller can watch the other ranks meanwhile (a rank that fails to start is reported at
    once, not after the rendezvous timeout). The dict gets ``"ok"``: (group, the build's
    result), or ``"error"``: the exception."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            group = init_distributed(0, world_size, init_method, device, TIMEOUT_S)
            result["ok"] = (group, build(spec, device, group))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="pagellm-tp-driver-start", daemon=True)
    thread.start()
    return thread, result


def worker_plan(plan: SchedulerOutput) -> SchedulerOutput:
    """The plan as the non-driver ranks need it: the tokens of this step only (not each
    sequence's whole history, which would make the message grow with the context), no
    sampling parameters (they do not sample, and a request's logits processors need not be
    picklable)."""
    scheduled = []
    for item in plan.scheduled:
        start = item.num_computed_tokens
        window = TokenWindow(start, len(item.token_ids),
                             tuple(item.token_ids[start:start + item.num_new_tokens]))
        scheduled.append(dataclasses.replace(item, token_ids=window, params=None,
                                             sample_ids=()))
    return dataclasses.replace(plan, scheduled=scheduled)


class TokenWindow:
    """The token ids ``start .. start + len(tokens)`` of a sequence of ``length`` tokens: what
    the model runner reads of a worker's plan (``token_ids[num_computed_tokens:end]`` and
    ``len(token_ids)``). Reading outside the window raises IndexError."""

    __slots__ = ("start", "length", "tokens")

    def __init__(self, start: int, length: int, tokens: tuple[int, ...]) -> None:
        self.start, self.length, self.tokens = start, length, tokens

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: slice) -> tuple[int, ...]:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise IndexError(f"a TokenWindow reads slices only, not {index!r}")
        begin, end, _ = index.indices(self.length)
        if begin < self.start or end > self.start + len(self.tokens):
            raise IndexError(f"tokens {begin}..{end} are outside the plan's window "
                             f"{self.start}..{self.start + len(self.tokens)}")
        return self.tokens[begin - self.start:end - self.start]

    def __reduce__(self):
        return TokenWindow, (self.start, self.length, self.tokens)


class MultiprocExecutor:
    """Runs each step on ``tensor_parallel_size`` ranks: this process and N-1 spawned ones.

    Invariant: while ``dead`` is None every worker process is alive and has answered every
    plan sent to it; once set, the executor refuses to run and every worker is stopped.
    """

    # the Worker's interface; LoRA is refused with tensor parallelism (check_tensor_parallel)
    lora_manager = None

    def __init__(self, spec: Any, device: torch.device) -> None:
        from pagellm.worker.engine_setup import build_rank_worker

        self.world_size = spec.args.tensor_parallel_size
        self.dead: str | None = None
        self._closing = False
        init_method = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self.processes: list[Any] = []
        self.conns: list[Any] = []
        self.failed = [context.Event() for _ in range(1, self.world_size)]  # set by a worker
        self._step_started: float | None = None  # while the driver runs its part of a step
        for rank in range(1, self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_worker_main, name=f"pagellm-tp-rank{rank}", daemon=True,
                args=(spec, rank, self.world_size, init_method, rank_device(device, rank),
                      child_end, self.failed[rank - 1], os.getpid(), torch.get_num_threads()))
            process.start()
            child_end.close()
            self.processes.append(process)
            self.conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self.conns)
        try:
            self.tp_group, self.driver = self._start_driver(spec, device, init_method,
                                                            build_rank_worker)
        except BaseException:
            self.shutdown()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="pagellm-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _start_driver(self, spec: Any, device: torch.device, init_method: str, build
                      ) -> tuple[TensorParallelGroup, Any]:
        """Join the group and build rank 0 in a helper thread while watching the workers: a
        worker that fails to start is reported at once, not after the rendezvous timeout."""
        thread, result = start_driver_thread(self.world_size, spec, device, init_method, build)
        ready = [False] * len(self.processes)
        deadline = time.monotonic() + TIMEOUT_S
        while thread.is_alive() or not all(ready):
            try:
                for i in range(len(self.processes)):
                    if not ready[i]:
                        ready[i] = self._poll_ready(i)
            except Exception:
                # the ranks check the same things: prefer the driver's own error (a
                # ValueError naming the setting) when it comes at about the same time
                thread.join(2.0)
                if "error" in result:
                    raise result["error"] from None
                raise
            thread.join(0.05)
            if "error" in result:
                raise result["error"]
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"the tensor-parallel ranks did not start within "
                                      f"{TIMEOUT_S:.0f} s (PAGELLM_TP_TIMEOUT_S)")
        return result["ok"]

    def _poll_ready(self, index: int) -> bool:
        conn, process = self.conns[index], self.processes[index]
        if conn.poll():
            status, detail = _recv(conn, index + 1, process)
            if status == "ready":
                return True
            raise RuntimeError(f"tensor-parallel rank {index + 1} failed to start: {detail}")
        if not process.is_alive():
            raise WorkerDiedError(f"tensor-parallel rank {index + 1} (pid {process.pid}) exited "
                                  f"with code {process.exitcode} while starting")
        return False

    # ------------------------------------------------------------------ steps
    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run ``plan`` on every rank; rank 0's output (the sampled tokens)."""
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        message = worker_plan(plan)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionError, OSError) as exc:
                raise self._fail(f"tensor-parallel rank {rank} is gone ({exc!r})") from exc
        error: Exception | None = None
        output = ModelRunnerOutput()
        self._step_started = time.monotonic()
        try:
            output = self.driver.worker.execute_model(plan)
        except Exception as exc:  # noqa: BLE001 - decided below, once the workers answered
            error = exc
        finally:
            self._step_started = None
        # after a failure here the workers may be blocked in a collective this rank left
        timeout = STRAGGLER_GRACE_S if error is not None else TIMEOUT_S
        failures = [(rank, self._answer(rank, timeout)) for rank in range(1, self.world_size)]
        failures = [(rank, text) for rank, text in failures if text is not None]
        if self.dead is None and error is not None and len(failures) in (0, len(self.conns)):
            # every rank failed the same way, or the workers finished the forward and only
            # this rank's own part failed (sampling): the ranks are in step, the engine goes on
            for event in self.failed:
                event.clear()
            raise error
        if failures or self.dead is not None:
            details = "; ".join(f"rank {rank} failed the step: {text}" for rank, text in failures)
            reason = self.dead or "the tensor-parallel ranks are out of step"
            raise self._fail(reason) from WorkerStepError(details or repr(error))
        return output

    def _answer(self, rank: int, timeout: float) -> str | None:
        """Wait for rank's acknowledgement: None, or its exception's text."""
        conn, process = self.conns[rank - 1], self.processes[rank - 1]
        ready = multiprocessing.connection.wait([conn, process.sentinel], timeout=timeout)
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass
        if not ready:
            raise self._fail(f"tensor-parallel rank {rank} did not answer within "
                             f"{timeout:.0f} s")
        process.join(1.0)
        raise self._fail(self.dead or f"tensor-parallel rank {rank} (pid {process.pid}) died "
                         f"with exit code {process.exitcode}")

    def _watch(self) -> None:
        """Wait for any worker to exit (unless the executor is closing, a failure), and for a
        worker that failed a step while the driver is still blocked in it."""
        sentinels = [p.sentinel for p in self.processes]
        failed_since: float | None = None
        while not self._closing:
            ready = multiprocessing.connection.wait(sentinels, timeout=0.5)
            if self._closing:
                return
            if ready:  # (reaped by the thread that drives the steps, never here)
                index = sentinels.index(ready[0])
                self._fail(f"tensor-parallel rank {index + 1} (pid "
                           f"{self.processes[index].pid}) died")
                return
            started = self._step_started
            stuck = [rank for rank, event in enumerate(self.failed, start=1) if event.is_set()]
            if started is None or not stuck:
                failed_since = None
                continue
            failed_since = failed_since or time.monotonic()
            if time.monotonic() - failed_since > STRAGGLER_GRACE_S:
                self._fail(f"tensor-parallel rank {stuck[0]} failed a step alone while rank 0 "
                           "waited for it in a collective")
                return

    def _fail(self, reason: str) -> WorkerDiedError:
        """Record the failure and stop every worker (a collective blocked on them fails)."""
        if self.dead is None:
            self.dead = reason
            logger.error("%s: stopping the other tensor-parallel ranks", reason)
        self._closing = True
        for process in self.processes:
            process.kill()  # a no-op for one already gone
        return WorkerDiedError(self.dead)

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Stop the workers (each leaves the process group) and leave it here too."""
        self._closing = True
        _stop_workers(self.processes, self.conns)
        destroy_distributed()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]


def _recv(conn: Any, rank: int, process: Any) -> Any:
    try:
        return conn.recv()
    except (EOFError, OSError) as exc:
        raise WorkerDiedError(f"tensor-parallel rank {rank} (pid {process.pid}) closed its "
                              f"pipe ({exc!r})") from exc


def _stop_workers(processes: list[Any], conns: list[Any]) -> None:
    """Ask each worker to leave (None on its pipe), then kill what is left."""
    for conn in conns:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0))
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(5.0)
    for conn in conns:
        conn.close()


def _worker_main(spec: Any, rank: int, world_size: int, init_method: str,
                 device: torch.device, conn: Any, failed: Any, parent_pid: int,
                 num_threads: int) -> None:
    """A worker process: join the group, build this rank's shard, then run every plan the
    driver sends until it sends None, its pipe closes or the driver is gone."""
    from pagellm.worker.engine_setup import build_rank_worker

    torch.set_num_threads(num_threads)
    try:
        group = init_distributed(rank, world_size, init_method, device, TIMEOUT_S)
        worker = build_rank_worker(spec, device, group).worker
        conn.send(("ready", None))
    except BaseException as exc:  # noqa: BLE001 - reported to the driver
        conn.send(("error", _describe(exc)))
        return
    try:
        _serve(worker, conn, failed, parent_pid)
    finally:
        destroy_distributed()


def _serve(worker: Any, conn: Any, failed: Any, parent_pid: int) -> None:
    while True:
        if not conn.poll(PARENT_POLL_S):
            if os.getppid() != parent_pid:
                return  # the driver is gone
            continue
        try:
            plan = conn.recv()
        except (EOFError, OSError):
            return
        if plan is None:
            return
        try:
            worker.execute_model(plan)
            answer = None
        except Exception as exc:  # noqa: BLE001 - the driver decides
            failed.set()
            answer = _describe(exc)
        try:
            conn.send(answer)
        except (OSError, ValueError):
            return


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()
