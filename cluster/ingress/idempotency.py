"""Idempotent retries: a request sent again with the same `Idempotency-Key` header gets the first one's answer.

A client that retries after a timeout or a 5xx would otherwise pay for the same answer twice. The first request with
a key claims it in Redis (`SET NX`), where every router replica sees it, and holds the claim with a short lease it
renews while it generates; its answer is then kept for `idempotency_window_s` seconds. A request with the same key:

- while the first runs, waits for it (on any replica) and gets its answer;
- after it finished, gets the kept answer at once, with `Idempotent-Replayed: true`;
- with a different body, is refused (422): a key names one request;
- after the first failed (no answer kept) or its replica died (the lease lapsed), runs as the first.

Non-streamed answers only are kept; a streamed request with a key claims it as streamed, and a second one gets a 409
(its answer went out as events; resuming a stream is not built yet). The X-Request-Id header is not a key: Ray
Serve's proxy sets one on every request.
"""

import asyncio
import contextlib
import hashlib
import json
import logging
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
MAX_KEY_CHARS = 256
_PREFIX = "s3:idempotent:"


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


def fingerprint(path: str, body: dict) -> str:
    """What makes two requests the same request: the endpoint and the parsed body, key order aside."""
    text = json.dumps([path, body], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _reused() -> APIError:
    return APIError(422, f"this {IDEMPOTENCY_HEADER} was used for a different request; a key names one request "
                         "(send a new key for a new request)", param=IDEMPOTENCY_HEADER, code="idempotency_key_reused")


def _streamed() -> APIError:
    return APIError(409, f"the request with this {IDEMPOTENCY_HEADER} was streamed; its answer cannot be sent again "
                         "(send a new key to generate it anew)", param=IDEMPOTENCY_HEADER,
                    code="idempotency_key_streamed")


class IdempotentAnswers:
    """Claims, leases and kept answers in Redis (an asyncio client, text responses).

    Args:
        client: `redis.asyncio.Redis` with decode_responses.
        window_s: how long a finished answer is kept for retries (the service's `idempotency_window_s`).
    """

    def __init__(self, client, window_s: float, lease_s: int = LEASE_S,
                 renew_s: float = RENEW_S, poll_s: float = WAIT_POLL_S) -> None:
        if window_s <= 0 or lease_s < 1 or not 0 < renew_s < lease_s or poll_s <= 0:
            raise ValueError(f"need window_s > 0, lease_s >= 1, 0 < renew_s < lease_s and poll_s > 0, got "
                             f"{window_s}, {lease_s}, {renew_s} and {poll_s}")
        self.client = client
        self.window_ms = max(1, int(window_s * 1000))
        self.lease_s, self.renew_s, self.poll_s = lease_s, renew_s, poll_s

    async def answer(self, key: str, request_print: str, stream: bool,
                     produce: Callable[[], Awaitable]) -> tuple[object, KeptAnswer | None]:
        """(what `produce` returned, None) for the first request with `key`; (None, the kept answer) for a retry.

        `produce` makes the response (a JSONResponse, or a stream when `stream`); a JSONResponse with status 200 is
        kept. Raises APIError 422 for a key used with another body, 409 for a key whose request was streamed."""
        name = _PREFIX + key
        try:
            kept = await self._claim(name, request_print, stream)
        except redis.exceptions.RedisError as error:
            raise unavailable(f"store of idempotent answers ({type(error).__name__})") from None
        if kept is not None:
            return None, kept
        if stream:  # kept as streamed for the window once its events start
            try:
                return await produce(), None
            except BaseException:
                await self._forget(name)  # refused before any event: a retry runs as the first
                raise
        renewing = asyncio.create_task(self._renew(name))
        try:
            response = await produce()
        except BaseException:
            await _stopped(renewing)
            await self._forget(name)  # no answer: a retry runs as the first
            raise
        await _stopped(renewing)
        if getattr(response, "status_code", None) != 200:
            await self._forget(name)
            return response, None
        headers = {k: v for k, v in response.headers.items() if k.startswith("x-")}
        entry = {"state": "done", "fingerprint": request_print, "status": response.status_code,
                 "body": bytes(response.body).decode("utf-8"), "headers": headers}
        try:
            await self.client.set(name, json.dumps(entry), px=self.window_ms)
        except redis.exceptions.RedisError as error:  # the answer stands; a retry generates it again
            logger.warning("idempotent answer for key %r not kept: %s: %s", name, type(error).__name__, error)
        return response, None

    async def _claim(self, name: str, request_print: str, stream: bool) -> KeptAnswer | None:
        """None once this request holds the key; the kept answer if an earlier one with the key finished."""
        running = json.dumps({"state": "streamed" if stream else "running", "fingerprint": request_print})
        expiry = {"px": self.window_ms} if stream else {"ex": self.lease_s}
        while not await self.client.set(name, running, nx=True, **expiry):
            kept = await self._read(name, request_print)
            if kept is not None:
                return kept
            await asyncio.sleep(self.poll_s)  # still running on some replica, or lapsed between the two calls
        return None

    async def _read(self, name: str, request_print: str) -> KeptAnswer | None:
        """The kept answer; None while the first runs (or when the claim has just lapsed)."""
        raw = await self.client.get(name)
        if raw is None:
            return None
        entry = json.loads(raw)
        if entry["fingerprint"] != request_print:
            raise _reused()
        if entry["state"] == "streamed":
            raise _streamed()
        if entry["state"] != "done":
            return None
        return KeptAnswer(entry["status"], entry["body"], entry["headers"])

    async def _renew(self, name: str) -> None:
        while True:
            await asyncio.sleep(self.renew_s)
            await self.client.expire(name, self.lease_s)

    async def _forget(self, name: str) -> None:
        with contextlib.suppress(Exception):  # the lease lapses on its own if Redis is away now
            await asyncio.shield(self.client.delete(name))


async def _stopped(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has stopped (so that no renewal lands after the answer is kept)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, redis.exceptions.RedisError):
        await task
