"""What goes into and comes out of a worker: requests, token events, timings, stats.

These cross process boundaries (Ray pickles them), so they hold plain values and
token tuples, and import neither torch nor Ray: the router and controller read
them without loading the engine. A moved sequence's KV travels as a *handle*:

    KVHandle = an `ExportedKV` (in one process) or a Ray ObjectRef resolving to one;
    the worker that exports puts the tensors in the object store, the worker that
    imports awaits the ref, so the bytes go worker to worker and the router only
    ever holds the ref.
"""

from dataclasses import dataclass
from typing import Any

from workers.values.sampling_params import SamplingParams
from workers.values.step_output import TokenLogprob

KVHandle = Any  # ExportedKV, or an awaitable (Ray ObjectRef) resolving to one


MAX_REPORTED_PREFIX_HASHES = 2048  # cached prefix blocks a worker reports with its stats (most recent)

@dataclass(frozen=True, slots=True)
class WorkRequest:
    """One request for a worker.

    Attributes:
        request_id: unique among the worker's live requests.
        prompt_token_ids: the prompt.
        params: sampling settings; `max_tokens` counts all output tokens, resumed ones included.
        predicted_output_tokens: the predictor's upper bound on output tokens (the reservation), if any.
        resumed_output_token_ids: tokens already sent to the client before a move or a worker failure;
            generation continues after them and they are never sent again.
        kv: handle to the KV of the first prompt + resumed tokens, exported by another worker (skips
            recomputing them); see `KVHandle`.
        arrival_s: `time.monotonic()` of this host when the request arrived; None means when the worker got it.
        priority: the request's class, lower is more urgent (admitted first, preempted last).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    predicted_output_tokens: int | None = None
    resumed_output_token_ids: tuple[int, ...] = ()
    kv: KVHandle | None = None
    arrival_s: float | None = None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class WorkMetrics:
    """Timings of a request on this worker, in `time.monotonic()` seconds of its host.

    Attributes:
        arrival_s: when the request arrived (WorkRequest.arrival_s, or when the worker got it).
        first_token_s: when this worker produced its first new token; None if it produced none.
        finish_s: when the request ended here.
        num_generated_tokens: new tokens produced here (resumed tokens excluded).
        num_preemptions: times the worker preempted it.
        num_cached_prompt_tokens: prompt tokens it found in this worker's prefix cache when first admitted (0 for
            a request that ended here before it finished: moved, aborted, failed).
    """

    arrival_s: float
    first_token_s: float | None
    finish_s: float
    num_generated_tokens: int
    num_preemptions: int
    num_cached_prompt_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Time to the first token produced on this worker."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def decode_s(self) -> float | None:
        """Time from the first new token to the end."""
        return None if self.first_token_s is None else self.finish_s - self.first_token_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per new token after the first; None with fewer than two."""
        if self.first_token_s is None or self.num_generated_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.num_generated_tokens - 1)

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True, slots=True)
class WorkEvent:
    """New tokens of one request; the last event of a stream has `finish_reason` set.

    Attributes:
        request_id: the request.
        token_ids: tokens since the previous event (several when the consumer fell behind).
        finish_reason: None while running, else "stop", "length", "abort", "moved" or "error".
        num_prompt_tokens: the prompt's length.
        num_output_tokens: output tokens so far, resumed ones included.
        moved_to: with "moved", the worker id the controller chose.
        kv: with "moved", a handle to the sequence's KV when it was moved with it (None when it had none).
        predicted_output_tokens: with "moved", the bound the sequence had when it left (raised by
            overruns), so that the target plans with it instead of the first prediction.
        error: with "error", what went wrong.
        metrics: on the last event, the request's timings on this worker.
        logprobs: with SamplingParams.logprobs, one per token of `token_ids`.
        prompt_logprobs: with SamplingParams.prompt_logprobs, on the event of the first output token: one per
            prompt token (None for the first).
    """

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    moved_to: str | None = None
    kv: KVHandle | None = None
    predicted_output_tokens: int | None = None
    error: str | None = None
    metrics: WorkMetrics | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class OverrunReport:
    """A sequence that was preempted (in s3: it outran its reservation and could not grow) and waits.

    Attributes:
        num_blocks_needed: KV blocks to hold it up to its next bound (the policy's reservation now).
    """

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    predicted_output_tokens: int | None
    num_blocks_needed: int


@dataclass(frozen=True, slots=True)
class BoundReport:
    """A sequence whose output bound the worker's length probe re-estimated from its hidden state.

    Attributes:
        num_output_tokens: tokens it had decoded when reported.
        predicted_output_tokens: the bound the worker plans it with now (decoded + the probe's estimate,
            raised again if it overran since).
        num_reserved_tokens: KV tokens the worker holds for it now (the controller never plans less).
    """

    request_id: str
    num_output_tokens: int
    predicted_output_tokens: int
    num_reserved_tokens: int = 0


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's KV blocks and load as of its latest step.

    Attributes:
        num_used_blocks: blocks holding computed KV of running sequences.
        num_reserved_blocks: blocks held by reservations (used or not); free + reserved = total.
        num_overruns: sequences so far whose predicted bound was raised after they outran it.
        num_migrated_in: requests that arrived with KV or resumed tokens from elsewhere.
        num_migrated_out: requests moved out.
        overruns: waiting sequences that were preempted: candidates to move elsewhere.
        request_ids: every request the engine holds (running, then waiting).
        prefix_hashes: hashes of cached prefix blocks, the most recently used last (at most
            `MAX_REPORTED_PREFIX_HASHES`), for prefix-aware placement.
        num_prompt_tokens: prompt tokens of requests at their first admission, so far.
        num_prefix_hit_tokens: of those, tokens found in the prefix cache.
        rebounded: sequences the length probe re-bounded, so the controller re-plans their reservations.
        num_probe_reads: reads of the length probe so far (one per sequence at each due point), 0 without a probe.
        remaining_tokens: per request of `request_ids`, the output tokens (decode steps) it is expected to take
            still, given that it is still going (`workers.scheduling.length_distribution`), for routing by
            predicted work (`cluster.control.routing`).
    """

    worker_id: str
    num_total_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_reserved_blocks: int
    block_size: int
    bytes_per_block: int
    num_running: int
    num_waiting: int
    num_steps: int
    num_generated_tokens: int
    num_overruns: int
    num_preemptions: int
    num_migrated_in: int
    num_migrated_out: int
    overruns: tuple[OverrunReport, ...]
    request_ids: tuple[str, ...]
    prefix_hashes: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    rebounded: tuple[BoundReport, ...] = ()
    num_probe_reads: int = 0
    remaining_tokens: tuple[int, ...] = ()
