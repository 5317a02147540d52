"""A streamed HTTP response that always closes its body generator.

Starlette's `StreamingResponse` leaves its body iterator suspended at a `yield` when the client
goes away (the send fails or the response task is cancelled). The generator's `finally` then
runs only when the garbage collector gets to it, seconds or minutes later, and until then the
request keeps its worker slot and its reserved KV blocks. `EventStream` closes the generator as
soon as the response ends, however it ends, so the abort and the release happen at once. A
generator that never started (the client left before the first byte) runs no `finally` when
closed, so what must be freed once per response belongs in `on_close`, which runs last, exactly once.
"""

from collections.abc import Awaitable, Callable

from fastapi.responses import StreamingResponse


class EventStream(StreamingResponse):
    """`text/event-stream` response whose body generator is closed when the response ends."""

    def __init__(self, body, headers: dict | None = None, on_close: Callable[[], Awaitable[None]] | None = None):
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                close = getattr(self.body_iterator, "aclose", None)
                if close is not None:
                    await close()
            finally:
                if self.on_close is not None:
                    await self.on_close()
