"""Idempotent retries against a real Redis: a key's first request generates, every other one with the key gets its
answer (waiting while it runs), and nothing is kept that a retry should generate again."""

import asyncio
import json

import pytest
from fastapi.responses import JSONResponse

from cluster.control.redis_server import connect_async
from cluster.ingress.errors import APIError
from cluster.ingress.idempotency import IdempotentAnswers, check_key, fingerprint, scoped_key


class _Generator:
    """Stands in for the completions endpoint: counts generations, each answer numbered."""

    def __init__(self, delay_s: float = 0.0, status: int = 200, fails: bool = False, by: str = "") -> None:
        self.calls, self.delay_s, self.status, self.fails, self.by = 0, delay_s, status, fails, by

    async def __call__(self):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fails:
            raise APIError(503, "worker lost")
        return JSONResponse({"answer": self.calls, "by": self.by}, status_code=self.status,
                            headers={"x-s3-overhead-ms": "1.0"})


def _run(server, check, **options):
    async def main():
        client = connect_async(server.url)
        try:
            await client.flushdb()
            return await check(IdempotentAnswers(client, **{"window_s": 60.0, **options}), client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def _replica(client, **options) -> IdempotentAnswers:
    """Another router replica's view of the same Redis."""
    return IdempotentAnswers(client, **{"window_s": 60.0, **options})


def test_a_retry_gets_the_first_answer_with_its_headers_and_nothing_is_generated_again(server):
    async def check(answers, _client):
        produce = _Generator()
        first, kept = await answers.answer("k1", "print", False, produce)
        assert kept is None and json.loads(first.body)["answer"] == 1
        again, kept = await answers.answer("k1", "print", False, produce)
        assert again is None and produce.calls == 1
        assert (kept.status, json.loads(kept.body)["answer"], kept.headers) == (200, 1, {"x-s3-overhead-ms": "1.0"})
        other, _ = await answers.answer("k2", "print", False, produce)  # another key is another request
        assert json.loads(other.body)["answer"] == 2

    _run(server, check)


def test_a_retry_while_the_first_runs_waits_for_it_even_past_the_lease(server):
    async def check(answers, _client):
        produce = _Generator(delay_s=1.6)  # past the 1 s lease: the first's replica renews its claim
        (first, _), (_, kept) = await asyncio.gather(answers.answer("k", "print", False, produce),
                                                     _later(answers.answer("k", "print", False, produce)))
        assert produce.calls == 1 and kept.body == bytes(first.body).decode()

    _run(server, check, lease_s=1, renew_s=0.3, poll_s=0.02)


async def _later(awaitable, delay_s: float = 0.2):
    await asyncio.sleep(delay_s)
    return await awaitable


def test_the_same_key_with_another_body_is_refused(server):
    async def check(answers, _client):
        await answers.answer("k", "print-a", False, _Generator())
        with pytest.raises(APIError) as refused:
            await answers.answer("k", "print-b", False, _Generator())
        assert refused.value.status_code == 422 and refused.value.code == "idempotency_key_reused"

    _run(server, check)


def test_what_failed_or_was_refused_is_generated_again_by_a_retry(server):
    async def check(answers, _client):
        with pytest.raises(APIError):
            await answers.answer("k", "print", False, _Generator(fails=True))
        produce = _Generator(status=429)
        refused, _ = await answers.answer("k", "print", False, produce)
        assert refused.status_code == 429
        retried, kept = await answers.answer("k", "print", False, produce)
        assert kept is None and retried.status_code == 429 and produce.calls == 2

    _run(server, check)


def test_a_claim_whose_replica_died_lapses_and_the_retry_generates(server):
    async def check(answers, client):
        # a replica claimed the key and died: nobody renews the 1 s lease
        dead = "0" * 32  # its owner's token
        await client.set("s3:idempotent:k", f"{dead} " + json.dumps({"state": "running", "fingerprint": "print"}),
                         ex=1)
        produce = _Generator()
        response, kept = await answers.answer("k", "print", False, produce)
        assert kept is None and produce.calls == 1 and response.status_code == 200

    _run(server, check, lease_s=1, renew_s=0.3, poll_s=0.02)


def test_two_replicas_claiming_at_once_generate_once(server):
    async def check(answers, client):
        produce = _Generator(delay_s=0.3)
        results = await asyncio.gather(*(replica.answer("k", "print", False, produce)
                                         for replica in (answers, _replica(client, poll_s=0.02))))
        assert produce.calls == 1
        assert sorted(kept is None for _, kept in results) == [False, True]

    _run(server, check)


def test_a_replica_whose_claim_lapsed_does_not_overwrite_the_answer_of_the_one_that_took_over(server):
    async def check(slow, client):
        async def never_renew(name, token):
            return None

        slow._renew = never_renew  # as if its renewals were lost: the lease lapses while it generates
        fast = _replica(client, lease_s=0.5, renew_s=0.2, poll_s=0.02)
        first = asyncio.create_task(slow.answer("k", "print", False, _Generator(delay_s=1.2, by="slow")))
        await asyncio.sleep(0.8)  # past the 0.5 s lease
        taken, kept = await fast.answer("k", "print", False, _Generator(by="fast"))
        assert kept is None and json.loads(taken.body)["by"] == "fast"
        await first  # finishes after the take-over, and keeps nothing over it
        _, kept = await fast.answer("k", "print", False, _Generator(by="third"))
        assert json.loads(kept.body)["by"] == "fast"

    _run(server, check, lease_s=0.5, renew_s=0.2, poll_s=0.02)


def test_a_retry_waits_at_most_its_bound_then_is_told_to_retry(server):
    async def check(answers, client):
        produce = _Generator(delay_s=1.0)
        first = asyncio.create_task(answers.answer("k", "print", False, produce))
        await asyncio.sleep(0.1)
        with pytest.raises(APIError) as refused:
            await _replica(client, poll_s=0.02, max_wait_s=0.3).answer("k", "print", False, produce)
        assert refused.value.status_code == 409 and refused.value.code == "idempotency_key_in_progress"
        assert refused.value.headers["Retry-After"] == "2"
        await first
        assert produce.calls == 1

    _run(server, check)


def test_a_request_cancelled_while_it_generates_leaves_the_key_to_a_retry(server):
    async def check(answers, _client):
        first = asyncio.create_task(answers.answer("k", "print", False, _Generator(delay_s=5.0)))
        await asyncio.sleep(0.2)
        first.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await first
        produce = _Generator()
        retried, kept = await asyncio.wait_for(answers.answer("k", "print", False, produce), timeout=2.0)
        assert kept is None and produce.calls == 1  # generated at once, not after a lapsed lease

    _run(server, check)


def test_a_streamed_request_is_not_streamed_twice_unless_it_was_refused_before_its_events(server):
    async def check(answers, _client):
        produce = _Generator()
        await answers.answer("s", "print", True, produce)
        with pytest.raises(APIError) as refused:
            await answers.answer("s", "print", True, produce)
        assert refused.value.status_code == 409 and produce.calls == 1
        with pytest.raises(APIError):
            await answers.answer("t", "print", True, _Generator(fails=True))
        streamed, _ = await answers.answer("t", "print", True, produce)
        assert streamed.status_code == 200 and produce.calls == 2

    _run(server, check)


def test_keys_and_fingerprints():
    assert check_key("retry-7f3a") == "retry-7f3a"
    for bad in ("", "with space", "é", "x" * 257):
        with pytest.raises(APIError, match="Idempotency-Key header must be"):
            check_key(bad)
    assert scoped_key("Bearer a", "k") != scoped_key("Bearer b", "k")  # one API key's keys never meet another's
    assert scoped_key("Bearer a", "k") == scoped_key("Bearer a", "k") != scoped_key(None, "k")
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    reordered = dict(reversed(body.items()))
    assert fingerprint("/v1/chat/completions", body) == fingerprint("/v1/chat/completions", reordered)
    assert fingerprint("/v1/chat/completions", body) != fingerprint("/v1/completions", body)
    assert fingerprint("/v1/chat/completions", body) != fingerprint("/v1/chat/completions", {**body, "max_tokens": 9})
    assert fingerprint("/v1/chat/completions", body) != fingerprint("/v1/chat/completions", body, ["thinking"])
    with pytest.raises(ValueError, match="renew_s < lease_s"):
        IdempotentAnswers(None, 60.0, lease_s=2, renew_s=2)
