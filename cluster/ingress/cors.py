"""CORS for the origins the service is configured with (`allowed_origins`, empty by default: off).

The app is built when its module is imported, before the router knows its configuration, and Starlette takes no
middleware once an app has started; so this middleware is installed with the app and reads the origins from
`app.state.allowed_origins`, which the router sets. With none it passes everything through untouched (a browser's
preflight then gets 405, as without CORS); with some it is Starlette's own `CORSMiddleware` for them.
"""

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send


class ConfiguredCors:
    """ASGI middleware: Starlette's CORS for `app.state.allowed_origins`, nothing when that is empty.

    Args:
        app: the wrapped ASGI app.
        state_app: the app whose `state.allowed_origins` holds the origins ("*" allows any).
    """

    def __init__(self, app: ASGIApp, state_app) -> None:
        self.app = app
        self.state_app = state_app
        self._cors: CORSMiddleware | None = None
        self._origins: tuple[str, ...] = ()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = tuple(getattr(self.state_app.state, "allowed_origins", ()) or ())
        if scope["type"] != "http" or not origins:
            await self.app(scope, receive, send)
            return
        if self._cors is None or origins != self._origins:
            self._cors = CORSMiddleware(self.app, allow_origins=list(origins), allow_methods=["*"],
                                        allow_headers=["*"], allow_credentials="*" not in origins)
            self._origins = origins
        await self._cors(scope, receive, send)


def install_cors(app) -> None:
    """Add `ConfiguredCors` to a FastAPI app (at build time), off until `app.state.allowed_origins` is set."""
    app.state.allowed_origins = ()
    app.add_middleware(ConfiguredCors, state_app=app)
