"""The engine driven by asyncio: one step thread, per-request token streams, commands between steps.

The engine is not thread-safe, so everything that touches it runs on one
dedicated thread, one *tick* at a time: first the queued commands (add,
abort, move out), then one `engine.step()`. The asyncio side only queues
commands and turns each tick's outputs into events on per-request queues:

    generate() --_Add--+                   step thread (one tick at a time)
    abort()    --_End--+--> command deque --> tick: apply commands, step(), snapshot stats
    move_out() --_End--+                            |
                                                    v  _Tick
    consumer <-- asyncio.Queue per request <-- _deliver(): events (tokens, final event)

A consumer that stops iterating aborts its request; an exception in a step
fails the requests in that step (finish_reason "error") and the loop goes on.
"""

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from workers.engine.engine import Engine
from workers.engine.kv_transfer import ExportedKV
from workers.engine.worker_snapshot import LoopCounters, snapshot
from workers.values.step_output import TokenLogprob
from workers.values.work_types import OverrunReport, WorkEvent, WorkerStats, WorkMetrics, WorkRequest

__all__ = ["EngineLoop", "ExportedKV", "OverrunReport", "WorkEvent", "WorkerStats", "WorkMetrics", "WorkRequest"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """The asyncio side of one request."""

    request: WorkRequest
    queue: asyncio.Queue
    arrival_s: float
    num_output_tokens: int
    first_token_s: float | None = None
    num_generated_tokens: int = 0
    is_ending: bool = False  # abort or move asked for: a second one is refused
    is_done: bool = False  # its final event is queued


@dataclass(frozen=True, slots=True)
class _Add:
    stream: _Stream
    added: asyncio.Future


@dataclass(frozen=True, slots=True)
class _End:
    """Abort (target None) or move out a request."""

    request_id: str
    reason: str
    target_worker_id: str | None = None
    with_kv: bool = False


@dataclass(frozen=True, slots=True)
class _Ended:
    """A request the tick removed from the engine (aborted, moved, failed)."""

    request_id: str
    reason: str
    num_preemptions: int
    moved_to: str | None = None
    kv: ExportedKV | None = None
    predicted_output_tokens: int | None = None  # the bound it left with (moved)
    error: str | None = None


@dataclass(slots=True)
class _Tick:
    """What one tick did, handed from the step thread to the event loop."""

    adds: list[tuple[_Add, Exception | None]] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # of the requests that ask
    prompt_logprobs: dict[str, tuple[TokenLogprob | None, ...]] = field(default_factory=dict)
    # id -> (reason, num_preemptions, num_cached_prompt_tokens)
    finished: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    ended: list[_Ended] = field(default_factory=list)
    done_s: float = 0.0
    has_work: bool = False
    stats: WorkerStats | None = None


class EngineLoop:
    """Serves concurrent token streams from one engine.

    Args:
        engine: the engine; from now on only this loop's step thread touches it.
        worker_id: reported in stats.
        idle_wait_s: longest sleep while idle (commands wake it at once).
    """

    def __init__(self, engine: Engine, worker_id: str, idle_wait_s: float = 0.05) -> None:
        self._engine = engine
        self.worker_id = worker_id
        self._idle_wait_s = idle_wait_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{worker_id}")
        self._commands: deque[_Add | _End] = deque()
        self._streams: dict[str, _Stream] = {}
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._is_closed = False
        self._has_work = False
        # Counters below are written on the step thread only.
        self._num_generated_tokens = 0
        self._num_migrated_in = 0
        self._num_migrated_out = 0
        self._stats = self._snapshot()

    # -- public API (event loop thread) -------------------------------------

    async def generate(self, request: WorkRequest) -> AsyncIterator[WorkEvent]:
        """Stream a request's new tokens; the last event has finish_reason set.

        Raises ValueError before any event when the engine refuses the request.
        """
        if self._is_closed:
            raise RuntimeError(f"worker {self.worker_id} is closed")
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._ensure_started()
        if request.kv is not None and inspect.isawaitable(request.kv):
            request = replace(request, kv=await _resolve_kv(request))
            if self._is_closed:
                raise RuntimeError(f"worker {self.worker_id} is closed")
            if request.request_id in self._streams:  # taken while its KV was fetched: one stream per id
                raise ValueError(f"request id {request.request_id!r} is already in use")
        arrival_s = time.monotonic() if request.arrival_s is None else request.arrival_s
        stream = _Stream(request, asyncio.Queue(), arrival_s, len(request.resumed_output_token_ids))
        self._streams[request.request_id] = stream
        added = asyncio.get_running_loop().create_future()
        self._submit(_Add(stream, added))
        try:
            await added
            while True:
                event = await stream.queue.get()
                while event.finish_reason is None and not stream.queue.empty():
                    event = _merge(event, stream.queue.get_nowait())
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not stream.is_done:
                self.abort(request.request_id)  # the consumer left (GeneratorExit, CancelledError)

    def abort(self, request_id: str) -> bool:
        """End a live request with finish_reason "abort" and free its blocks; False if unknown or ending."""
        return self._end(_End(request_id, "abort"))

    def move_out(self, request_id: str, target_worker_id: str, with_kv: bool) -> bool:
        """End a live request with finish_reason "moved" (and its KV when `with_kv`); False if unknown or ending.

        A request that finishes in the step running now ends with its own reason instead.
        """
        return self._end(_End(request_id, "moved", target_worker_id, with_kv))

    def stats(self) -> WorkerStats:
        """The worker's state as of the latest tick."""
        return self._stats

    async def close(self) -> None:
        """Stop the loop; every open stream ends with finish_reason "abort"."""
        self._is_closed = True
        if self._task is not None:
            self._wakeup.set()
            await self._task
            for stream in list(self._streams.values()):
                self._commands.append(_End(stream.request.request_id, "abort"))
            if self._commands:
                tick = await asyncio.get_running_loop().run_in_executor(self._executor, self._tick, False)
                self._deliver(tick)
        self._executor.shutdown(wait=True)

    # -- event loop side ------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-loop-{self.worker_id}")

    def _submit(self, command: "_Add | _End") -> None:
        self._commands.append(command)
        if self._wakeup is not None:
            self._wakeup.set()

    def _end(self, command: _End) -> bool:
        stream = self._streams.get(command.request_id)
        if stream is None or stream.is_ending or stream.is_done:
            return False
        stream.is_ending = True
        self._submit(command)
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._is_closed:
            self._wakeup.clear()
            if not self._commands and not self._has_work:
                try:
                    await asyncio.wait_for(self._wakeup.wait(), self._idle_wait_s)
                except TimeoutError:
                    pass
                continue
            try:
                tick = await loop.run_in_executor(self._executor, self._tick, True)
                self._deliver(tick)
            except Exception:
                # A bug outside the step (which _tick contains): keep serving, but say so.
                logger.exception("worker %s: engine loop tick failed", self.worker_id)
                await asyncio.sleep(self._idle_wait_s)

    def _deliver(self, tick: _Tick) -> None:
        self._has_work = tick.has_work
        self._stats = tick.stats
        for add, error in tick.adds:
            stream = add.stream
            if error is not None:
                self._streams.pop(stream.request.request_id, None)
                stream.is_done = True
            if not add.added.done():  # done means the caller was cancelled while waiting
                if error is None:
                    add.added.set_result(None)
                else:
                    add.added.set_exception(error)
        for request_id, token_ids in tick.tokens.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            if stream.first_token_s is None:
                stream.first_token_s = tick.done_s
            stream.num_output_tokens += len(token_ids)
            stream.num_generated_tokens += len(token_ids)
            reason, num_preemptions, num_cached = tick.finished.get(request_id, (None, 0, 0))
            logprobs = tick.logprobs.get(request_id)
            self._push(stream, tuple(token_ids), reason, num_preemptions, tick.done_s, num_cached,
                       logprobs=None if logprobs is None else tuple(logprobs),
                       prompt_logprobs=tick.prompt_logprobs.get(request_id))
        for ended in tick.ended:
            stream = self._streams.get(ended.request_id)
            if stream is not None:
                self._push(stream, (), ended.reason, ended.num_preemptions, tick.done_s,
                           moved_to=ended.moved_to, kv=ended.kv, error=ended.error,
                           predicted_output_tokens=ended.predicted_output_tokens)

    def _push(self, stream: _Stream, token_ids: tuple[int, ...], reason: str | None, num_preemptions: int,
              now_s: float, num_cached_prompt_tokens: int = 0, **extra) -> None:
        metrics = None
        if reason is not None:
            stream.is_done = True
            del self._streams[stream.request.request_id]
            metrics = WorkMetrics(stream.arrival_s, stream.first_token_s, now_s, stream.num_generated_tokens,
                                  num_preemptions, num_cached_prompt_tokens)
        stream.queue.put_nowait(WorkEvent(
            request_id=stream.request.request_id,
            token_ids=token_ids,
            finish_reason=reason,
            num_prompt_tokens=len(stream.request.prompt_token_ids),
            num_output_tokens=stream.num_output_tokens,
            metrics=metrics,
            **extra,
        ))

    # -- step thread side -------------------------------------------------------

    def _tick(self, step: bool) -> _Tick:
        """Apply the queued commands, then run one step; runs on the step thread only."""
        tick = _Tick()
        while self._commands:
            command = self._commands.popleft()
            if isinstance(command, _Add):
                tick.adds.append((command, self._apply_add(command.stream.request)))
            else:
                ended = self._apply_end(command)
                if ended is not None:
                    tick.ended.append(ended)
        engine = self._engine
        if step and engine.has_unfinished():
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("worker %s: engine step failed; failing the requests in it", self.worker_id)
                tick.ended.extend(self._fail_step(exc))
            else:
                self._num_generated_tokens += len(outputs)
                for out in outputs:
                    tick.tokens.setdefault(out.seq_id, []).append(out.token_id)
                    if out.logprob is not None:
                        tick.logprobs.setdefault(out.seq_id, []).append(out.logprob)
                    if out.prompt_logprobs is not None:
                        tick.prompt_logprobs[out.seq_id] = out.prompt_logprobs
                    if out.is_finished:
                        tick.finished[out.seq_id] = (out.finish_reason, out.metrics.num_preemptions,
                                                     out.metrics.num_cached_prompt_tokens)
        tick.done_s = time.monotonic()
        tick.has_work = engine.has_unfinished()
        tick.stats = self._snapshot()
        return tick

    def _apply_add(self, request: WorkRequest) -> Exception | None:
        try:
            self._engine.add_request(
                list(request.prompt_token_ids),
                request.params,
                seq_id=request.request_id,
                predicted_output_tokens=request.predicted_output_tokens,
                arrival_s=request.arrival_s,
                resumed_output_token_ids=list(request.resumed_output_token_ids),
                kv=request.kv,
                priority=request.priority,
            )
        except Exception as exc:  # reaches the caller of generate(); nothing else changed
            return exc
        if request.kv is not None or request.resumed_output_token_ids:
            self._num_migrated_in += 1
        return None

    def _apply_end(self, command: _End) -> _Ended | None:
        seq = self._engine.sequence(command.request_id)
        if seq is None:
            return None  # it finished (or failed) before the command came
        kv = None
        if command.with_kv:
            try:
                kv = self._engine.export_sequence(command.request_id)
            except Exception:
                # The target recomputes instead; losing the KV must not lose the request.
                logger.exception("worker %s: exporting the KV of %s failed", self.worker_id, command.request_id)
            if kv is not None and kv.num_computed_tokens == 0:
                kv = None
        num_preemptions, bound = seq.num_preemptions, seq.predicted_output_tokens
        failed = self._abort(command.request_id)
        if failed is not None:
            return _Ended(command.request_id, "error", num_preemptions, error=failed)
        if command.reason == "moved":
            self._num_migrated_out += 1
        return _Ended(command.request_id, command.reason, num_preemptions, command.target_worker_id, kv,
                      bound if command.reason == "moved" else None)

    def _fail_step(self, exc: Exception) -> list[_Ended]:
        scheduler = self._engine.scheduler
        # The sequences of the failed forward; if none ran (scheduling itself failed), every queued one,
        # so that a persistent error cannot spin on the same requests forever.
        affected = list(scheduler.running) or list(scheduler.waiting)
        error = f"engine step failed: {type(exc).__name__}: {exc}"
        ended = []
        for seq in affected:
            self._abort(seq.seq_id)
            ended.append(_Ended(seq.seq_id, "error", seq.num_preemptions, error=error))
        return ended

    def _abort(self, request_id: str) -> str | None:
        """Drop a request from the engine; the error if that failed (a tensor-parallel engine whose ranks fell
        out of step refuses; its stats poll then fails and the controller replaces the worker)."""
        try:
            self._engine.abort(request_id)
        except Exception as exc:
            logger.exception("worker %s: dropping %s failed", self.worker_id, request_id)
            return f"dropping the request failed: {type(exc).__name__}: {exc}"
        return None

    def _snapshot(self) -> WorkerStats:
        counters = LoopCounters(self._num_generated_tokens, self._num_migrated_in, self._num_migrated_out)
        return snapshot(self._engine, self.worker_id, counters)


async def _resolve_kv(request: WorkRequest) -> ExportedKV | None:
    """The KV behind a handle (a Ray ObjectRef from the exporting worker); None, to recompute, if it is lost."""
    try:
        return await request.kv
    except Exception:  # noqa: BLE001 - the exporter died or the object was evicted: recomputing loses nothing
        logger.warning("KV of moved request %s could not be fetched; recomputing it", request.request_id,
                       exc_info=True)
        return None


def _merge(first: WorkEvent, second: WorkEvent) -> WorkEvent:
    """One event for two consecutive ones of a request (the consumer fell behind)."""
    logprobs = second.logprobs if first.logprobs is None else first.logprobs + (second.logprobs or ())
    return replace(second, token_ids=first.token_ids + second.token_ids, logprobs=logprobs,
                   prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs)
