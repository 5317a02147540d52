"""What the controller stores and what it exchanges with routers: plain dataclasses (no Ray, Redis or torch).

Records are the controller's durable state (`cluster.control.store` keeps them in
Redis); the rest crosses the router <-> controller boundary through Ray.
"""

from dataclasses import dataclass

from workers.values.work_types import WorkerStats

WORKER_STATES = ("starting", "ready", "dead")
REQUEST_STATES = ("pending", "placed")


class QueueFullError(Exception):
    """Too many requests already wait in the controller's queue: the router answers 429."""


class PlacementTimeoutError(Exception):
    """No worker had room within placement_timeout_s: the router answers 503."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker actor as the controller remembers it.

    Attributes:
        worker_id: the worker's id.
        actor_name: its named Ray actor, so a restarted controller can find it again.
        num_total_blocks: blocks of its KV cache.
        block_size: tokens per block.
        state: "starting", "ready" or "dead".
        started_s: wall-clock time (time.time()) when it was started.
    """

    worker_id: str
    actor_name: str
    num_total_blocks: int
    block_size: int
    state: str
    started_s: float

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if self.state not in WORKER_STATES:
            raise ValueError(f"worker {self.worker_id!r}: state must be one of {WORKER_STATES}, got {self.state!r}")
        if self.num_total_blocks < 0:
            raise ValueError(f"worker {self.worker_id!r}: num_total_blocks must be >= 0, got {self.num_total_blocks}")
        if self.block_size < 1:
            raise ValueError(f"worker {self.worker_id!r}: block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A request in the controller's ledger, from placement until it finishes.

    The router that accepted a request owns its journey (tokens sent so far, where it
    streams from) and re-places it after a worker failure; the ledger holds what
    placement needs: sizes, the current bound and where its KV is reserved.

    Attributes:
        request_id: the request's id.
        worker_id: where it is placed; None while pending or once requeued.
        num_prompt_tokens: prompt length.
        max_tokens: the client's output limit.
        predicted_output_tokens: the bound it is planned with now (raised when it overran and moved).
        num_reserved_blocks: KV blocks reserved for it on `worker_id` (its policy's `placement_tokens`, in
            blocks: its plan, or for s3_peak and sglang_ratio what it holds on admission).
        state: "pending" (waiting for room or requeued) or "placed".
        num_attempts: placements so far (a re-placement after a worker's death or a move adds one).
        created_s: wall-clock time it entered the ledger.
    """

    request_id: str
    worker_id: str | None
    num_prompt_tokens: int
    max_tokens: int
    predicted_output_tokens: int
    num_reserved_blocks: int
    state: str
    num_attempts: int
    created_s: float

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if self.state not in REQUEST_STATES:
            raise ValueError(f"request {self.request_id!r}: state must be one of {REQUEST_STATES}, got {self.state!r}")
        if self.worker_id == "":
            raise ValueError(f"request {self.request_id!r}: worker_id must be None or non-empty, got ''")
        if self.state == "placed" and self.worker_id is None:
            raise ValueError(f"request {self.request_id!r}: a placed request needs a worker_id")
        for name in ("num_prompt_tokens", "max_tokens", "predicted_output_tokens", "num_reserved_blocks",
                     "num_attempts"):
            if getattr(self, name) < 0:
                raise ValueError(f"request {self.request_id!r}: {name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs (the controller's answer to `place`)."""

    request_id: str
    worker_id: str
    actor_name: str
    num_reserved_blocks: int
    queued_s: float = 0.0  # time spent waiting for KV room (queueing, not overhead)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What the router saw of a finished request (feeds metrics and retraining)."""

    prompt_text: str
    num_prompt_tokens: int
    max_tokens: int
    temperature: float
    num_output_tokens: int
    predicted_output_tokens: int | None
    finish_reason: str


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    """The controller's view for /health, /metrics and the dashboard."""

    workers: tuple[WorkerRecord, ...]
    stats: tuple[WorkerStats, ...]  # latest poll of each ready worker
    reserved_blocks: dict[str, int]
    num_pending: int
    counters: dict[str, int]
    is_redis_ok: bool
