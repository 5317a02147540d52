"""Idempotent retries: a request sent again with the same `Idempotency-Key` header gets the first one's answer.

A client that retries after a timeout or a 5xx would otherwise pay for the same answer twice. The first request with
a key claims it in Redis (`SET NX`), where every router replica sees it, and holds the claim with a short lease it
renews while it generates; its answer is then kept for `idempotency_window_s` seconds. A request with the same key:

- while the first runs, waits for it (on any replica, up to a minute, then a 409 to retry) and gets its answer;
- after it finished, gets the kept answer at once, with `Idempotent-Replayed: true`;
- with a different body, is refused (422): a key names one request;
- after the first failed (no answer kept) or its replica died (the lease lapsed), runs as the first.

Non-streamed answers only are kept (up to 4 MiB each); a streamed request with a key is kept as streamed once its
events start, and a second one gets a 409 (its answer went out as events; resuming a stream is not built yet). Each
claim carries its owner's token, and the owner renews, stores or forgets it only while it still holds it (a Lua
compare-and-set), so a replica whose lease lapsed never overwrites the answer of the one that took over. The
X-Request-Id header is not a key: Ray Serve's proxy sets one on every request.
"""

import asyncio
import contextlib
import hashlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis

from cluster.ingress.errors import APIError, bad_request, unavailable

logger = logging.getLogger(__name__)

IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
LEASE_S = 30  # a claim lapses this long after its replica stops renewing it (the replica died)
RENEW_S = 10.0
WAIT_POLL_S = 0.1
MAX_WAIT_S = 60.0  # a retry waits this long for a first request still running, then gets a 409 to retry
MAX_KEPT_BYTES = 4 * 1024 * 1024  # larger answers are not kept: a retry generates them again
MAX_KEY_CHARS = 256
_PREFIX = "s3:idempotent:"
_TOKEN_CHARS = 32  # a claim's value: its owner's token (uuid4 hex), a space, then the entry's JSON
# Each acts only while the claim is the caller's (ARGV[1]): renew its lease, replace its value, forget it.
_RENEW = """if string.sub(redis.call('GET', KEYS[1]) or '', 1, 32) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"""
_REPLACE = """if string.sub(redis.call('GET', KEYS[1]) or '', 1, 32) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end return 0"""
_FORGET = """if string.sub(redis.call('GET', KEYS[1]) or '', 1, 32) == ARGV[1] then
  return redis.call('DEL', KEYS[1]) end return 0"""


@dataclass(frozen=True, slots=True)
class KeptAnswer:
    """A finished non-streamed answer as it was sent: status, JSON body text and the headers worth repeating."""

    status: int
    body: str
    headers: dict[str, str]


def check_key(key: str) -> str:
    """The header's value, refused (400) unless 1 to 256 visible ASCII characters."""
    if not 0 < len(key) <= MAX_KEY_CHARS or not all(33 <= ord(c) <= 126 for c in key):
        raise bad_request(f"the {IDEMPOTENCY_HEADER} header must be 1 to {MAX_KEY_CHARS} visible ASCII characters",
                          param=IDEMPOTENCY_HEADER)
    return key


def scoped_key(authorization: str | None, key: str) -> str:
    """The header's value (checked) within its client's scope: requests under one API key never meet another's."""
    scope = hashlib.sha256((authorization or "").encode("utf-8")).hexdigest()[:16]
    return f"{scope}:{check_key(key)}"


def fingerprint(path: str, body: dict, unknown: list[str] = ()) -> str:
    """What makes two requests the same request: the endpoint, the parsed body (key order aside) and the names of
    the fields no request model declares (their values are not parsed)."""
    text = json.dumps([path, body, sorted(unknown)], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _reused() -> APIError:
    return APIError(422, f"this {IDEMPOTENCY_HEADER} was used for a different request; a key names one request "
                         "(send a new key for a new request)", param=IDEMPOTENCY_HEADER, code="idempotency_key_reused")


def _still_running() -> APIError:
    return APIError(409, f"the first request with this {IDEMPOTENCY_HEADER} is still running; retry to get its "
                         "answer", param=IDEMPOTENCY_HEADER, code="idempotency_key_in_progress",
                    headers={"Retry-After": "2"})


def _streamed() -> APIError:
    return APIError(409, f"the request with this {IDEMPOTENCY_HEADER} was streamed; its answer cannot be sent again "
                         "(send a new key to generate it anew)", param=IDEMPOTENCY_HEADER,
                    code="idempotency_key_streamed")


class IdempotentAnswers:
    """Claims, leases and kept answers in Redis.

    Args:
        client: `redis.asyncio.Redis` with decode_responses (`cluster.control.redis_server.connect_async`).
        window_s: how long a finished answer is kept for retries (the service's `idempotency_window_s`).
        lease_s, renew_s: a claim's lease and how often its owner renews it.
        poll_s, max_wait_s: how often a retry looks for the first one's answer, and for how long.
    """

    def __init__(self, client: "redis.asyncio.Redis", window_s: float, lease_s: float = LEASE_S,
                 renew_s: float = RENEW_S, poll_s: float = WAIT_POLL_S, max_wait_s: float = MAX_WAIT_S) -> None:
        if window_s <= 0 or not 0 < renew_s < lease_s or poll_s <= 0 or max_wait_s < 0:
            raise ValueError(f"need window_s > 0, 0 < renew_s < lease_s, poll_s > 0 and max_wait_s >= 0, got "
                             f"{window_s}, {renew_s}, {lease_s}, {poll_s} and {max_wait_s}")
        self.client = client
        self.window_ms = max(1, int(window_s * 1000))
        self.lease_ms = max(1, int(lease_s * 1000))
        self.renew_s, self.poll_s, self.max_wait_s = renew_s, poll_s, max_wait_s
        self._renew_script = client.register_script(_RENEW)
        self._replace_script = client.register_script(_REPLACE)
        self._forget_script = client.register_script(_FORGET)

    async def answer(self, key: str, request_print: str, stream: bool,
                     produce: Callable[[], Awaitable]) -> tuple[object, KeptAnswer | None]:
        """(what `produce` returned, None) for the first request with `key`; (None, the kept answer) for a retry.

        `produce` makes the response (a JSONResponse, or a stream when `stream`, returned once its first event
        came); a JSONResponse with status 200 is kept. Raises APIError: 422 for a key used with another body, 409
        for a key whose request was streamed or still runs past the wait, 503 when Redis does not answer."""
        name, token = _PREFIX + key, uuid.uuid4().hex
        try:
            kept = await self._claim(name, token, request_print)
        except redis.exceptions.RedisError as error:
            raise unavailable(f"store of idempotent answers ({type(error).__name__})") from None
        if kept is not None:
            return None, kept
        renewing = asyncio.create_task(self._renew(name, token))
        try:
            response = await produce()
        except BaseException:
            await _stopped(renewing)
            await self._forget(name, token)  # no answer: a retry runs as the first
            raise
        await _stopped(renewing)
        if stream:  # its events have started: kept as streamed for the window
            await self._replace(name, token, {"state": "streamed", "fingerprint": request_print})
            return response, None
        body = bytes(getattr(response, "body", b""))
        if getattr(response, "status_code", None) != 200 or len(body) > MAX_KEPT_BYTES:
            await self._forget(name, token)
            return response, None
        headers = {k: v for k, v in response.headers.items() if k.startswith("x-")}
        await self._replace(name, token, {"state": "done", "fingerprint": request_print,
                                          "status": response.status_code, "body": body.decode("utf-8"),
                                          "headers": headers})
        return response, None

    async def _claim(self, name: str, token: str, request_print: str) -> KeptAnswer | None:
        """None once this request holds the key; the kept answer if an earlier one with the key finished."""
        running = f"{token} " + json.dumps({"state": "running", "fingerprint": request_print})
        waited_s = 0.0
        while not await self.client.set(name, running, nx=True, px=self.lease_ms):
            raw = await self.client.get(name)
            if raw is not None and raw[:_TOKEN_CHARS] == token:
                return None  # our own claim: the SET landed but its reply was lost, and the client sent it again
            kept = _kept(raw, request_print)
            if kept is not None:
                return kept
            if waited_s >= self.max_wait_s:
                raise _still_running()
            await asyncio.sleep(self.poll_s)  # still running on some replica, or lapsed between the two calls
            waited_s += self.poll_s
        return None

    async def _renew(self, name: str, token: str) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                if not await self._renew_script(keys=[name], args=[token, self.lease_ms]):
                    logger.warning("idempotency claim %r lapsed while its request ran; a retry may run it again",
                                   name)
                    return
            except redis.exceptions.RedisError as error:  # keep trying: the lease outlasts a short outage
                logger.warning("idempotency claim %r not renewed: %s: %s", name, type(error).__name__, error)

    async def _replace(self, name: str, token: str, entry: dict) -> None:
        try:
            if not await self._replace_script(keys=[name], args=[token, f"{token} {json.dumps(entry)}",
                                                                 self.window_ms]):
                logger.warning("idempotency claim %r was taken over; its answer is not kept", name)
        except redis.exceptions.RedisError as error:  # the answer stands; a retry generates it again
            logger.warning("idempotent answer for %r not kept: %s: %s", name, type(error).__name__, error)

    async def _forget(self, name: str, token: str) -> None:
        with contextlib.suppress(Exception):  # the lease lapses on its own if Redis is away now
            await asyncio.shield(self._forget_script(keys=[name], args=[token]))


def _kept(raw: str | None, request_print: str) -> KeptAnswer | None:
    """The kept answer in a claim's value; None while the first runs (or when the claim has just lapsed)."""
    if raw is None:
        return None
    entry = json.loads(raw[_TOKEN_CHARS + 1:])
    if entry["fingerprint"] != request_print:
        raise _reused()
    if entry["state"] == "streamed":
        raise _streamed()
    if entry["state"] != "done":
        return None
    return KeptAnswer(entry["status"], entry["body"], entry["headers"])


async def _stopped(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has stopped (so that no renewal lands after the answer is kept), leaving a
    cancellation of the caller itself to propagate."""
    task.cancel()
    await asyncio.wait([task])
