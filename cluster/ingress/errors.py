"""OpenAI-shaped HTTP errors of the router, their FastAPI handlers and the body-size guard.

Every error the service answers has OpenAI's body, so the official clients raise the
matching exception class (BadRequestError, AuthenticationError, RateLimitError, ...):

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Status codes (DESIGN.md, Router): 400 bad input, 401 missing/wrong API key, 404 unknown
model or route, 413 prompt too long or body too large, 429 queue full (with Retry-After),
503 controller or Redis unreachable; 500 only for our own bugs, never for bad input.
"""

import hmac
import logging

import fastapi
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

# Validation problems listed in one message; the rest are counted, not spelled out.
_MAX_LISTED_PROBLEMS = 3


class APIError(Exception):
    """An error answered to the client with an OpenAI-shaped body.

    Attributes:
        status_code: HTTP status.
        message: human-readable explanation, safe to show the client.
        type: OpenAI error type ("invalid_request_error", ...).
        param: the offending request field, if one is to blame.
        code: machine-readable code ("model_not_found", ...), if any.
        headers: extra response headers (Retry-After, WWW-Authenticate).
    """

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers) if headers else {}

    def body(self) -> dict:
        """The JSON body of the response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The whole response: status, body and headers."""
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers or None)


def bad_request(message: str, param: str | None = None) -> APIError:
    """400: the request is malformed or asks for something we do not serve."""
    return APIError(400, message, param=param)


def unauthorized(message: str = "Missing or incorrect API key; send 'Authorization: Bearer <key>'.") -> APIError:
    """401: API keys are configured and the request's is missing or wrong."""
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def not_found_model(model: str) -> APIError:
    """404: the request names a model this service does not serve."""
    return APIError(404, f"The model '{model}' does not exist on this server.", param="model", code="model_not_found")


def prompt_too_long(num_tokens: int, max_tokens: int, param: str = "prompt") -> APIError:
    """400 with OpenAI's code context_length_exceeded, as OpenAI and vLLM answer: the prompt has more tokens than
    the model accepts (param "messages" for chat)."""
    return APIError(
        400,
        f"The prompt has {num_tokens} tokens, more than the {max_tokens} this model accepts.",
        param=param,
        code="context_length_exceeded",
    )


def queue_full(retry_after_s: int) -> APIError:
    """429: the admission queue is full; the client should retry after `retry_after_s` seconds."""
    if retry_after_s < 0:
        raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
    return APIError(
        429,
        f"The server is at capacity; retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(what: str, retry_after_s: int = 2) -> APIError:
    """503: a part the service needs (`what`: "controller", "Redis", ...) is unreachable; retry after a while."""
    if retry_after_s < 0:
        raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
    return APIError(503, f"The {what} is unavailable; retry after {retry_after_s} s.", type="service_unavailable",
                    code="unavailable", headers={"Retry-After": str(retry_after_s)})


def body_too_large(limit_bytes: int) -> APIError:
    """413: the request body exceeds the configured limit."""
    return APIError(413, f"The request body exceeds the limit of {limit_bytes} bytes.", code="body_too_large")


def internal_error() -> APIError:
    """500: our bug; the message says nothing about its cause (that goes to the log)."""
    return APIError(500, "The server had an internal error.", type="internal_error", code="internal_error")


def check_api_key(authorization: str | None, api_keys: frozenset[str]) -> None:
    """Raises unauthorized() unless no keys are configured or the Bearer token is one of them.

    Every key is compared in constant time (hmac.compare_digest) and all keys are tried,
    so timing tells neither the key nor which one matched.
    """
    if not api_keys:
        return
    scheme, _, token = (authorization or "").strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise unauthorized()
    token_bytes = token.encode()
    is_match = False
    for key in api_keys:
        is_match |= hmac.compare_digest(token_bytes, key.encode())
    if not is_match:
        raise unauthorized("Incorrect API key provided.")


def _param(loc: tuple) -> str | None:
    # ("body", "messages", 0, "content") -> "messages[0].content"
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "header", "path"):
        parts = parts[1:]
    param = ""
    for part in parts:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param or None


def _problem(error: dict) -> tuple[str, str | None]:
    """(message, param) for one pydantic error dict, without echoing the input."""
    param = _param(tuple(error.get("loc", ())))
    kind = error.get("type", "")
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "malformed JSON")
        return f"The request body is not valid JSON: {reason}.", None
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        if kind == "missing":
            return "The request body is missing; send a JSON object.", None
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return "The request body must be a JSON object (Content-Type: application/json).", None
        return message, None  # a rule across fields (e.g. stream_options without stream)
    if kind == "missing":
        message = "this field is required"
    return f"{param}: {message}", param


def validation_error(errors: list[dict]) -> APIError:
    """400 for pydantic errors: the first few problems in one message, the first field as param."""
    problems = [_problem(error) for error in errors] or [("The request is invalid.", None)]
    message = "; ".join(text for text, _ in problems[:_MAX_LISTED_PROBLEMS])
    if len(problems) > _MAX_LISTED_PROBLEMS:
        message += f" (and {len(problems) - _MAX_LISTED_PROBLEMS} more)"
    return bad_request(message, param=problems[0][1])


def _http_error(status_code: int, detail: str, method: str, path: str) -> APIError:
    if status_code == 404:
        return APIError(404, f"No route for {method} {path}.", code="not_found")
    if status_code == 405:
        return APIError(405, f"Method {method} is not allowed on {path}.", code="method_not_allowed")
    error_type = "invalid_request_error" if status_code < 500 else "internal_error"
    return APIError(status_code, detail, type=error_type)


def install_error_handlers(app: fastapi.FastAPI) -> None:
    """Answers every error of `app` with an OpenAI-shaped body and the right status."""

    async def on_api_error(request: fastapi.Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def on_validation_error(request: fastapi.Request, exc: RequestValidationError | ValidationError):
        return validation_error(list(exc.errors())).response()

    async def on_http_error(request: fastapi.Request, exc: StarletteHTTPException) -> JSONResponse:
        error = _http_error(exc.status_code, str(exc.detail), request.method, request.url.path)
        response = error.response()
        # Keep e.g. the Allow header of a 405.
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    async def on_unexpected_error(request: fastapi.Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return internal_error().response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)


class BodySizeLimit:
    """Pure ASGI middleware: answers 413 to a request whose body exceeds `max_body_bytes`.

    A declared Content-Length over the limit is refused before any byte is read; any other
    body (chunked, or a lying length) is read and counted here, up to the limit, before the
    app sees it, then replayed to the app. Our endpoints read whole JSON bodies anyway,
    so buffering costs nothing.

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: largest accepted body.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = body_too_large(self.max_body_bytes).response()
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await too_large(scope, receive, send)
                return
        messages: list[Message] = []
        num_bytes = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # http.disconnect: let the app see it
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                await too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            # Buffered messages first, then the live channel (disconnect notices).
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
