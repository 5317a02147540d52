"""The controller's durable state in Redis, through an asyncio client (the controller's event loop never blocks).

Key layout (`prefix` defaults to "s3"; every key starts with it, so services can share a Redis):

    s3:ctl:worker:<worker_id>          HASH  worker_id, actor_name, num_total_blocks, block_size,
                                             state, started_s
    s3:ctl:workers                     SET   worker_ids                    (index of the hashes above)

    s3:ctl:request:<request_id>        HASH  request_id, worker_id ("" = none), num_prompt_tokens,
                                             max_tokens, predicted_output_tokens, num_reserved_blocks,
                                             state, num_attempts, created_s
    s3:ctl:requests:state:<state>      SET   request_ids in that state     (each request in exactly one)
    s3:ctl:requests:worker:<worker_id> SET   request_ids whose worker_id is that worker

    s3:ctl:counters                    HASH  counter name -> integer (migrations, requeues, overruns, ...)
    s3:ctl:finished:<request_id>:<counter>  STR  "1" once the request was counted (expires after an hour)
    s3:ctl:config                      STR   the controller's ServiceConfig as JSON (written by the controller
                                             itself; read back when Ray restarts it after a rollout)

Beside them the predictor's `s3:predictor:samples` STREAM (finished requests) and
`s3:predictor:retrain:last` HASH, and the routers' `s3:idempotent:<scope>:<key>` STR (a claimed
Idempotency-Key and, once answered, its answer: `cluster.ingress.idempotency`). A request's record
and its two index entries change together in one Lua script (one round trip, atomic in Redis), so a controller restarted
at any moment finds the indices consistent with the records. The scripts touch keys they
compute from the prefix: fine on a standalone Redis, not on Redis Cluster.
"""

from dataclasses import asdict

import redis.asyncio

from cluster.control.messages import REQUEST_STATES, RequestRecord, WorkerRecord

# KEYS[1] request hash; ARGV: base, request_id, new state, new worker ("" = none), then field, value pairs.
_PUT_REQUEST = """
local old = redis.call('HMGET', KEYS[1], 'state', 'worker_id')
local base, rid, state, wid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if old[1] and old[1] ~= state then redis.call('SREM', base .. ':requests:state:' .. old[1], rid) end
if old[2] and old[2] ~= '' and old[2] ~= wid then redis.call('SREM', base .. ':requests:worker:' .. old[2], rid) end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('SADD', base .. ':requests:state:' .. state, rid)
if wid ~= '' then redis.call('SADD', base .. ':requests:worker:' .. wid, rid) end
return 1
"""

# KEYS[1] request hash; ARGV: base, request_id, counter ("" = none), stream key ("" = none), stream maxlen,
# marker ttl in seconds, then the stream entry's field, value pairs. Returns 1 if the request existed.
# Everything or nothing; the counter and the stream entry are written once per request id and counter (a
# marker key remembers it for the ttl), so a call retried after a lost reply, or replayed after a Redis restart,
# never counts a request twice.
_DELETE_REQUEST = """
redis.replicate_commands()
local old = redis.call('HMGET', KEYS[1], 'state', 'worker_id')
if old[1] then
  redis.call('DEL', KEYS[1])
  redis.call('SREM', ARGV[1] .. ':requests:state:' .. old[1], ARGV[2])
  if old[2] and old[2] ~= '' then redis.call('SREM', ARGV[1] .. ':requests:worker:' .. old[2], ARGV[2]) end
end
if (ARGV[3] ~= '' or ARGV[4] ~= '') and
   redis.call('SET', ARGV[1] .. ':finished:' .. ARGV[2] .. ':' .. ARGV[3], '1', 'NX', 'EX', ARGV[6]) then
  if ARGV[3] ~= '' then redis.call('HINCRBY', ARGV[1] .. ':counters', ARGV[3], 1) end
  if ARGV[4] ~= '' then redis.call('XADD', ARGV[4], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 7)) end
end
if old[1] then return 1 end
return 0
"""

# KEYS[1] counters hash; ARGV: counter, value pairs. Raises each counter to at least its value.
_RAISE_COUNTERS = """
for i = 1, #ARGV, 2 do
  local current = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0')
  if current < tonumber(ARGV[i + 1]) then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
return 1
"""

FINISHED_MARKER_TTL_S = 3600  # how long a counted request id is remembered (replays come within minutes)


class ControllerStore:
    """Workers, the request ledger, counters and config, in Redis.

    Args:
        client: a `redis.asyncio.Redis` (from `cluster.control.redis_server.connect_async`).
        prefix: first part of every key.
    """

    def __init__(self, client: redis.asyncio.Redis, prefix: str = "s3") -> None:
        if not prefix:
            raise ValueError("prefix must not be empty")
        self.client = client
        self.prefix = prefix
        self._base = f"{prefix}:ctl"
        self._put_request = client.register_script(_PUT_REQUEST)
        self._delete_request = client.register_script(_DELETE_REQUEST)
        self._raise_counters = client.register_script(_RAISE_COUNTERS)

    # -- workers ----------------------------------------------------------------

    async def put_worker(self, record: WorkerRecord) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(self._worker_key(record.worker_id), mapping=_encode(asdict(record)))
            pipe.sadd(self._workers_key(), record.worker_id)
            await pipe.execute()

    async def workers(self) -> list[WorkerRecord]:
        """Every worker recorded, by worker id."""
        worker_ids = sorted(_text(i) for i in await self.client.smembers(self._workers_key()))
        async with self.client.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hgetall(self._worker_key(worker_id))
            raw = await pipe.execute()
        return [record for record in map(_worker, raw) if record is not None]

    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker for good (its requests must have moved on)."""
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(self._worker_key(worker_id))
            pipe.srem(self._workers_key(), worker_id)
            await pipe.execute()

    # -- requests -----------------------------------------------------------------

    async def put_request(self, record: RequestRecord) -> None:
        """Insert or replace a request, moving it between state and worker indices atomically (one round trip)."""
        fields = _encode(asdict(record))
        flat = [item for pair in fields.items() for item in pair]
        await self._put_request(keys=[self._request_key(record.request_id)],
                                args=[self._base, record.request_id, record.state, record.worker_id or "", *flat])

    async def delete_request(self, request_id: str, counter: str | None = None,
                             stream: tuple[str, dict, int] | None = None) -> None:
        """Remove a request and its index entries (a no-op when absent) and, in the same script (one round
        trip, atomic), add one to `counter` and an entry (key, fields, maxlen) to a stream."""
        args = [self._base, request_id, counter or ""]
        if stream is None:
            args += ["", 0, FINISHED_MARKER_TTL_S]
        else:
            key, fields, maxlen = stream
            args += [key, maxlen, FINISHED_MARKER_TTL_S, *[item for pair in _encode(fields).items() for item in pair]]
        await self._delete_request(keys=[self._request_key(request_id)], args=args)

    async def get_request(self, request_id: str) -> RequestRecord | None:
        return _request(await self.client.hgetall(self._request_key(request_id)))

    async def requests(self, state: str | None = None) -> list[RequestRecord]:
        """Requests in `state` (all when None), oldest first."""
        if state is not None and state not in REQUEST_STATES:
            raise ValueError(f"state must be one of {REQUEST_STATES} or None, got {state!r}")
        states = REQUEST_STATES if state is None else (state,)
        return await self._records(await self.client.sunion([self._state_key(s) for s in states]))

    async def requests_on(self, worker_id: str) -> list[RequestRecord]:
        """Requests whose worker_id is `worker_id`, oldest first."""
        return await self._records(await self.client.smembers(self._on_worker_key(worker_id)))

    # -- counters, config, health ---------------------------------------------------

    async def incr(self, counter: str, amount: int = 1) -> int:
        """Add `amount` to a named counter; returns the new value."""
        return int(await self.client.hincrby(self._counters_key(), counter, amount))

    async def counters(self) -> dict[str, int]:
        return {_text(k): int(v) for k, v in (await self.client.hgetall(self._counters_key())).items()}

    async def raise_counters(self, counters: dict[str, int]) -> None:
        """Raise each stored counter to at least the given value (after a Redis restart lost recent increments)."""
        if counters:
            await self._raise_counters(keys=[self._counters_key()],
                                       args=[item for pair in counters.items() for item in pair])

    async def run_id(self) -> str:
        """The Redis server's run id: a new one means the server restarted (and may have lost its last writes)."""
        return str((await self.client.info("server"))["run_id"])

    async def get_config(self) -> str | None:
        value = await self.client.get(self._config_key())
        return None if value is None else _text(value)

    async def set_config(self, config_json: str) -> None:
        await self.client.set(self._config_key(), config_json)

    async def ping(self) -> bool:
        """True when Redis answers (after the client's own retries), False otherwise."""
        try:
            return bool(await self.client.ping())
        except (redis.RedisError, OSError):
            return False

    # -- keys and reads ---------------------------------------------------------------

    async def _records(self, request_ids) -> list[RequestRecord]:
        async with self.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hgetall(self._request_key(_text(request_id)))
            raw = await pipe.execute()
        records = [record for record in map(_request, raw) if record is not None]
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

    def _config_key(self) -> str:
        return f"{self._base}:config"


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
        num_attempts=int(fields["num_attempts"]), created_s=float(fields["created_s"]))


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
