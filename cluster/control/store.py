"""All durable controller state, in Redis, behind dataclasses.

Key layout (prefix `s3` by default; `<id>` is the raw id, which may itself contain ':'):

    s3:ctl:worker:<worker_id>          HASH  worker_id, actor_name, num_total_blocks, block_size,
                                             state, started_s
    s3:ctl:workers                     SET   worker_ids                    (index of the hashes above)

    s3:ctl:request:<request_id>        HASH  request_id, worker_id ("" = none), num_prompt_tokens,
                                             max_tokens, predicted_output_tokens, num_reserved_blocks,
                                             state, num_attempts, created_s, payload
    s3:ctl:requests:state:<state>      SET   request_ids in that state     (each request in exactly one)
    s3:ctl:requests:worker:<worker_id> SET   request_ids whose worker_id is that worker (any state)

    s3:ctl:counters                    HASH  counter name -> integer (migrations, requeues, overruns, ...)
    s3:ctl:config                      STR   the controller's ServiceConfig as JSON (written by the controller
                                             itself; read back when Ray restarts it after a rollout)

Beside the controller's keys: s3:predictor:samples (STREAM of finished requests, see
predictor_service/sample_stream.py) and s3:predictor:retrain:last (HASH, the last
retraining attempt, see predictor_service/retraining.py).

Writes that touch a record and its indices run in one MULTI/EXEC transaction, guarded by
WATCH on the record, so a crash or a concurrent writer never leaves an index pointing at a
state or worker the record no longer has. Readers go from index to hashes and skip ids whose
hash is gone, so a read racing a delete returns a consistent subset.
"""

from dataclasses import asdict, dataclass

import redis

WORKER_STATES = ("starting", "ready", "dead")
REQUEST_STATES = ("pending", "placed", "finished", "cancelled")


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
    """A request in the controller's ledger.

    Attributes:
        request_id: the request's id.
        worker_id: where it is placed; None while pending or once requeued.
        num_prompt_tokens: prompt length.
        max_tokens: the client's output limit.
        predicted_output_tokens: the predicted upper bound its reservation was made for.
        num_reserved_blocks: KV blocks reserved for it on `worker_id`.
        state: "pending", "placed", "finished" or "cancelled".
        num_attempts: placements so far (requeues after a worker death or migration add one).
        created_s: wall-clock time it entered the ledger.
        payload: opaque text the controller needs to re-submit the request after a failure
            (e.g. JSON of prompt token ids and sampling parameters); the store never parses it.
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
    payload: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        if self.state not in REQUEST_STATES:
            raise ValueError(f"request {self.request_id!r}: state must be one of {REQUEST_STATES}, got {self.state!r}")
        if self.worker_id == "":
            raise ValueError(f"request {self.request_id!r}: worker_id must be None or non-empty, got ''")
        for name in ("num_prompt_tokens", "max_tokens", "predicted_output_tokens", "num_reserved_blocks",
                     "num_attempts"):
            if getattr(self, name) < 0:
                raise ValueError(f"request {self.request_id!r}: {name} must be >= 0, got {getattr(self, name)}")


class ControllerStore:
    """The controller's durable state: workers, the request ledger and counters.

    Args:
        client: a `redis.Redis`, preferably from `cluster.control.redis_server.connect` (text
            responses, retries across Redis restarts); a bytes client works too.
        prefix: first part of every key, so several services can share one Redis.
    """

    def __init__(self, client: redis.Redis, prefix: str = "s3") -> None:
        if not prefix:
            raise ValueError("prefix must not be empty")
        self.client = client
        self.prefix = prefix
        self._base = f"{prefix}:ctl"

    # Workers

    def put_worker(self, record: WorkerRecord) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self._worker_key(record.worker_id), mapping=_encode(asdict(record)))
        pipe.sadd(self._workers_key(), record.worker_id)
        pipe.execute()

    def get_worker(self, worker_id: str) -> WorkerRecord | None:
        return _worker(self.client.hgetall(self._worker_key(worker_id)))

    def workers(self) -> list[WorkerRecord]:
        """Every worker recorded, by worker id."""
        worker_ids = sorted(_text(i) for i in self.client.smembers(self._workers_key()))
        pipe = self.client.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.hgetall(self._worker_key(worker_id))
        return [record for record in map(_worker, pipe.execute()) if record is not None]

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker; its requests stay in the ledger (requeue them first)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self._worker_key(worker_id))
        pipe.srem(self._workers_key(), worker_id)
        pipe.execute()

    # Requests

    def put_request(self, record: RequestRecord) -> None:
        """Insert or replace a request, moving it between state and worker indices atomically."""
        key = self._request_key(record.request_id)

        def write(pipe: redis.client.Pipeline) -> None:
            old_state, old_worker_id = (_text(v) if v is not None else None
                                        for v in pipe.hmget(key, ["state", "worker_id"]))
            pipe.multi()
            if old_state is not None and old_state != record.state:
                pipe.srem(self._state_key(old_state), record.request_id)
            if old_worker_id and old_worker_id != record.worker_id:
                pipe.srem(self._on_worker_key(old_worker_id), record.request_id)
            pipe.hset(key, mapping=_encode(asdict(record)))
            pipe.sadd(self._state_key(record.state), record.request_id)
            if record.worker_id is not None:
                pipe.sadd(self._on_worker_key(record.worker_id), record.request_id)

        self.client.transaction(write, key)

    def get_request(self, request_id: str) -> RequestRecord | None:
        return _request(self.client.hgetall(self._request_key(request_id)))

    def requests(self, state: str | None = None) -> list[RequestRecord]:
        """Requests in `state` (all when None), oldest first."""
        if state is not None and state not in REQUEST_STATES:
            raise ValueError(f"state must be one of {REQUEST_STATES} or None, got {state!r}")
        states = REQUEST_STATES if state is None else (state,)
        return self._records(self.client.sunion([self._state_key(s) for s in states]))

    def requests_on(self, worker_id: str, state: str | None = None) -> list[RequestRecord]:
        """Requests whose worker_id is `worker_id` (in `state`, or any when None), oldest first."""
        if state is not None and state not in REQUEST_STATES:
            raise ValueError(f"state must be one of {REQUEST_STATES} or None, got {state!r}")
        records = self._records(self.client.smembers(self._on_worker_key(worker_id)))
        return [r for r in records if state is None or r.state == state]

    def delete_request(self, request_id: str) -> None:
        """Remove a request and its index entries; a no-op when it is not there."""
        key = self._request_key(request_id)

        def delete(pipe: redis.client.Pipeline) -> None:
            old_state, old_worker_id = (_text(v) if v is not None else None
                                        for v in pipe.hmget(key, ["state", "worker_id"]))
            pipe.multi()
            pipe.delete(key)
            if old_state is not None:
                pipe.srem(self._state_key(old_state), request_id)
            if old_worker_id:
                pipe.srem(self._on_worker_key(old_worker_id), request_id)

        self.client.transaction(delete, key)

    def reserved_blocks_by_worker(self) -> dict[str, int]:
        """Sum of num_reserved_blocks of placed requests, per worker (workers with none are absent)."""
        request_ids = [_text(i) for i in self.client.smembers(self._state_key("placed"))]
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hmget(self._request_key(request_id), ["worker_id", "num_reserved_blocks", "state"])
        totals: dict[str, int] = {}
        for worker_id, num_blocks, state in pipe.execute():
            # A request re-written between the two reads may have left "placed"; count what it is now.
            if worker_id and num_blocks is not None and _text(state) == "placed":
                totals[_text(worker_id)] = totals.get(_text(worker_id), 0) + int(num_blocks)
        return totals

    # Counters and health

    def incr(self, counter: str, amount: int = 1) -> int:
        """Add `amount` to a named counter (e.g. "migrations", "requeues", "overruns"); returns the new value."""
        return int(self.client.hincrby(self._counters_key(), counter, amount))

    def counters(self) -> dict[str, int]:
        return {_text(k): int(v) for k, v in self.client.hgetall(self._counters_key()).items()}

    def ping(self) -> bool:
        """True when Redis answers (after the client's own retries), False otherwise."""
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    # Keys and reads

    def _records(self, request_ids) -> list[RequestRecord]:
        pipe = self.client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hgetall(self._request_key(_text(request_id)))
        records = [record for record in map(_request, pipe.execute()) if record is not None]
        return sorted(records, key=lambda r: (r.created_s, r.request_id))

    def _worker_key(self, worker_id: str) -> str:
        return f"{self._base}:worker:{worker_id}"

    def _workers_key(self) -> str:
        return f"{self._base}:workers"

    def _request_key(self, request_id: str) -> str:
        return f"{self._base}:request:{request_id}"

    def _state_key(self, state: str) -> str:
        return f"{self._base}:requests:state:{state}"

    def _on_worker_key(self, worker_id: str) -> str:
        return f"{self._base}:requests:worker:{worker_id}"

    def _counters_key(self) -> str:
        return f"{self._base}:counters"


def _encode(fields: dict) -> dict[str, str]:
    # None is stored as "" (Redis hashes hold strings); floats by repr so they round-trip exactly.
    return {k: "" if v is None else repr(v) if isinstance(v, float) else str(v) for k, v in fields.items()}


def _worker(raw: dict) -> WorkerRecord | None:
    if not raw:
        return None
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return WorkerRecord(worker_id=fields["worker_id"], actor_name=fields["actor_name"],
                        num_total_blocks=int(fields["num_total_blocks"]), block_size=int(fields["block_size"]),
                        state=fields["state"], started_s=float(fields["started_s"]))


def _request(raw: dict) -> RequestRecord | None:
    if not raw:
        return None
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return RequestRecord(
        request_id=fields["request_id"], worker_id=fields["worker_id"] or None,
        num_prompt_tokens=int(fields["num_prompt_tokens"]), max_tokens=int(fields["max_tokens"]),
        predicted_output_tokens=int(fields["predicted_output_tokens"]),
        num_reserved_blocks=int(fields["num_reserved_blocks"]), state=fields["state"],
        num_attempts=int(fields["num_attempts"]), created_s=float(fields["created_s"]),
        payload=fields.get("payload", ""))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
