"""EventStream closes its body generator when the client goes away, not when the GC gets to it."""

import asyncio

import pytest
from cluster.ingress.event_stream import EventStream


def _body(log: list[str]):
    async def events():
        try:
            for i in range(100):
                yield f"data: {i}\n\n".encode()
                log.append(f"sent {i}")
        finally:
            log.append("closed")
    return events()


async def _serve(response_class, spec_version: str, log: list[str]):
    body = _body(log)  # held here, so only an explicit close can run its finally
    sent: list[dict] = []
    disconnected = asyncio.Event()

    async def send(message: dict) -> None:
        sent.append(message)
        if len(sent) == 3:  # start, then two events: the client goes away
            disconnected.set()
            if spec_version == "2.4":
                raise OSError("connection reset by peer")
            await asyncio.sleep(3600)  # a stuck send, ended by the disconnect listener

    async def receive() -> dict:
        await disconnected.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": spec_version}}
    try:
        await asyncio.wait_for(response_class(body)(scope, receive, send), timeout=10)
    except Exception:  # noqa: BLE001 - starlette reports the reset as ClientDisconnect; not the point here
        pass
    await asyncio.sleep(0.1)  # any close the response scheduled has run by now
    return body, list(log)  # before asyncio.run's shutdown closes every open generator


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_generator_is_closed_when_the_client_disconnects(spec_version):
    log: list[str] = []
    body, seen = asyncio.run(_serve(EventStream, spec_version, log))
    assert seen[-1] == "closed", seen
    assert seen.count("closed") == 1 and body is not None


def test_on_close_runs_even_when_the_body_never_started():
    """The client left before the first byte: closing an unstarted generator runs no `finally`."""
    log: list[str] = []

    async def main():
        async def send(message):
            raise OSError("connection reset by peer")

        async def receive():
            await asyncio.sleep(3600)

        async def on_close():
            log.append("on_close")
        try:
            await EventStream(_body(log), on_close=on_close)({"type": "http", "asgi": {"spec_version": "2.4"}},
                                                             receive, send)
        except Exception:  # noqa: BLE001 - starlette reports the reset as ClientDisconnect
            pass
        return list(log)
    assert asyncio.run(main()) == ["on_close"]


def test_a_finished_stream_is_closed_once():
    log: list[str] = []

    async def main():
        async def events():
            try:
                yield b"data: 1\n\n"
            finally:
                log.append("closed")
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            await asyncio.sleep(3600)
        await EventStream(events(), headers={"x-a": "1"})({"type": "http", "asgi": {"spec_version": "2.4"}},
                                                           receive, send)
        return sent
    sent = asyncio.run(main())
    assert log == ["closed"]
    assert sent[0]["status"] == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
