"""One request's trip through the cluster: predict, place, stream, survive moves and dead workers.

    predict (Serve handle) -> controller.place -> worker.generate (Ray streaming generator)
        event "moved"      -> continue on event.moved_to with the tokens so far, the bound the
                              sequence left with, and a handle to its KV (an object ref: the
                              target fetches the bytes from the source; they never pass here; a
                              target drops it when the request scores a prompt it has not finished)
        worker died        -> controller.place(exclude=dead worker) -> continue with the tokens so far
        client went away   -> worker.abort, controller.finish
    the tokens already sent are never generated again: a continuation starts after them.
"""

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from cluster.config import RAY_NAMESPACE
from cluster.control.messages import RequestOutcome
from workers.values.sampling_params import SamplingParams
from workers.values.work_types import WorkEvent, WorkRequest

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # moves and failovers of one request before giving up
# What a call to an actor that is gone raises: killed or crashed (RayActorError), unreachable for now, or killed by
# Ray's memory monitor, whose victims' callers get OutOfMemoryError, which is no RayActorError.
LOST_ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                     ray.exceptions.OutOfMemoryError)


@dataclass(frozen=True, slots=True)
class GenerationJob:
    request_id: str
    prompt_text: str  # for the training sample
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    predicted_output_tokens: int | None
    point_output_tokens: int | None
    priority: int = 0  # lower is more urgent
    prefix_hashes: tuple[int, ...] = ()  # leading prompt block hashes, for prefix-aware placement
    sibling_of: str | None = None  # a request of the same prompt placed before (one of `n` choices)


@dataclass(slots=True)
class GenerationResult:
    output_token_ids: list[int]
    finish_reason: str | None = None
    placed_s: float | None = None
    queued_s: float = 0.0  # of the first placement: waiting for KV room
    place_call_s: float = 0.0  # of the first placement: the controller call without the waiting
    first_token_s: float | None = None
    finish_s: float | None = None
    num_moves: int = 0
    num_failovers: int = 0
    num_cached_prompt_tokens: int = 0  # of the prompt, found in the finishing worker's prefix cache


class WorkerGone(LookupError):
    """No actor holds a worker's name any more: it died and was not restarted (its requests are re-placed)."""


class WorkerHandles:
    """Actor handles by worker id, looked up by name once."""

    def __init__(self) -> None:
        self._handles: dict[str, ray.actor.ActorHandle] = {}

    def get(self, worker_id: str, actor_name: str):
        handle = self._handles.get(worker_id)
        if handle is None:
            try:
                handle = ray.get_actor(actor_name, namespace=RAY_NAMESPACE)
            except ValueError as error:  # Ray's answer for a name no live actor holds
                raise WorkerGone(f"worker {worker_id} ({actor_name}) is gone") from error
            self._handles[worker_id] = handle
        return handle

    def forget(self, worker_id: str) -> None:
        self._handles.pop(worker_id, None)


async def run_job(job: GenerationJob, controller, workers: WorkerHandles, result: GenerationResult,
                  worker_name_of) -> AsyncIterator[WorkEvent]:
    """Yield the worker's events that bring new output tokens (with their logprobs, if asked) as they come; fill
    `result`; always release the reservation.

    `worker_name_of(worker_id)` gives a worker's actor name (moves carry only the id).
    """
    asked_s = time.monotonic()
    placing = controller.place.remote(job.request_id, len(job.prompt_token_ids), job.params.max_tokens,
                                      job.predicted_output_tokens, priority=job.priority,
                                      prefix_hashes=job.prefix_hashes, sibling_of=job.sibling_of)
    try:
        placement = await placing
    except asyncio.CancelledError:
        # The client left while we waited. Release now (it may be queued: this frees its place in the
        # queue) and again once the placement call returns (it may have landed after the first release;
        # a release of a request the ledger no longer holds changes nothing).
        _release(controller, job.request_id, None)
        placing.future().add_done_callback(lambda _: _release(controller, job.request_id, None))
        raise
    result.placed_s = time.monotonic()
    result.place_call_s = result.placed_s - asked_s - placement.queued_s
    result.queued_s = placement.queued_s
    worker_id, actor_name = placement.worker_id, placement.actor_name
    kv = None
    bound = job.predicted_output_tokens  # raised by overruns: a moved request continues with its current bound
    outcome_reason = None
    try:
        for _ in range(MAX_ATTEMPTS):
            request = WorkRequest(job.request_id, job.prompt_token_ids, job.params, bound,
                                  tuple(result.output_token_ids), kv, priority=job.priority)
            kv = None
            try:
                handle = workers.get(worker_id, actor_name)
                async for ref in handle.generate.remote(request):
                    event: WorkEvent = await ref
                    if event.token_ids:
                        if result.first_token_s is None:
                            result.first_token_s = time.monotonic()
                        result.output_token_ids.extend(event.token_ids)
                        yield event
                    if event.finish_reason == "moved":
                        result.num_moves += 1
                        worker_id, actor_name, kv = event.moved_to, worker_name_of(event.moved_to), event.kv
                        bound = event.predicted_output_tokens or bound
                        break
                    if event.finish_reason == "error":
                        raise RuntimeError(f"worker {worker_id} failed the request: {event.error}")
                    if event.finish_reason is not None:
                        if event.metrics is not None:
                            result.num_cached_prompt_tokens = event.metrics.num_cached_prompt_tokens
                        result.finish_reason = outcome_reason = event.finish_reason
                        result.finish_s = time.monotonic()
                        return
                else:
                    raise RuntimeError(f"worker {worker_id} ended the stream without a finish reason")
            except (*LOST_ACTOR_ERRORS, WorkerGone) as error:
                logger.warning("request %s lost worker %s (%s); re-placing it", job.request_id, worker_id,
                               type(error).__name__)
                result.num_failovers += 1
                workers.forget(worker_id)
                placement = await controller.place.remote(
                    job.request_id, len(job.prompt_token_ids), job.params.max_tokens, bound,
                    len(result.output_token_ids), worker_id, job.priority)
                worker_id, actor_name = placement.worker_id, placement.actor_name
        raise RuntimeError(f"request {job.request_id} was moved or failed over {MAX_ATTEMPTS} times")
    finally:
        if outcome_reason is None:  # cancelled or failed: stop the work wherever it is
            try:
                # no child of a cancelled request either (see `_release`)
                contextvars.Context().run(workers.get(worker_id, actor_name).abort.remote, job.request_id)
            except Exception:  # noqa: BLE001 - the worker may be gone; nothing left to stop then
                pass
        outcome = RequestOutcome(job.prompt_text, len(job.prompt_token_ids), job.params.max_tokens,
                                 job.params.temperature, len(result.output_token_ids), job.predicted_output_tokens,
                                 outcome_reason or "cancelled")
        _release(controller, job.request_id, outcome)


def _release(controller, request_id: str, outcome: RequestOutcome | None, resends_left: int = 2) -> None:
    """Send the release now, without awaiting it (this runs in `finally`, perhaps of a cancelled task).

    The call is submitted before this returns; its failure is only logged (a lost release is
    repaired when the controller reconciles its ledger with the workers). Ray cancels the
    child tasks of a cancelled request (`ray.cancel` is recursive), and an async actor's
    current task is a context variable: the release is submitted from an empty context, so
    that it is no child of the request, and sent again should it be cancelled all the same.
    """
    ref = contextvars.Context().run(controller.finish.remote, request_id, outcome)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # called back from a Ray thread (the placement call returned)
        loop = None

    def report(future) -> None:
        if future.cancelled() or future.exception() is None:
            return
        if isinstance(future.exception(), ray.exceptions.TaskCancelledError) and resends_left > 0:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(_release, controller, request_id, outcome, resends_left - 1,
                                          context=contextvars.Context())
            else:
                _release(controller, request_id, outcome, resends_left - 1)
            return
        logger.error("could not release request %s: %r", request_id, future.exception())

    ref.future().add_done_callback(report)
