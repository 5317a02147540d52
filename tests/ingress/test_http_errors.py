"""OpenAI-shaped errors, status codes, API keys and the body-size guard, through a tiny FastAPI app."""

import asyncio
import json
import logging

import fastapi
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from cluster.ingress import errors
from cluster.ingress.openai_protocol import ChatCompletionRequest, CompletionRequest

MAX_BODY_BYTES = 4096
API_KEYS = frozenset({"key-one", "key-two"})
MODEL = "smollm2"


class Strict(BaseModel):
    count: int


def make_app(api_keys: frozenset[str] = API_KEYS) -> fastapi.FastAPI:
    app = fastapi.FastAPI()
    errors.install_error_handlers(app)
    app.add_middleware(errors.BodySizeLimit, max_body_bytes=MAX_BODY_BYTES)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, authorization: str | None = fastapi.Header(None)):
        errors.check_api_key(authorization, api_keys)
        if req.model != MODEL:
            raise errors.not_found_model(req.model)
        if len(req.prompt) > 100:
            raise errors.prompt_too_long(len(req.prompt), 100)
        return {"ok": True}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        return {"num_messages": len(req.messages)}

    @app.get("/busy")
    async def busy():
        raise errors.queue_full(retry_after_s=3)

    @app.get("/down")
    async def down():
        raise errors.unavailable("controller")

    @app.get("/manual")
    async def manual():
        Strict.model_validate({"count": "many"})  # a pydantic error outside FastAPI's own parsing

    @app.get("/bug")
    async def bug():
        raise RuntimeError("secret internal detail")

    return app


@pytest.fixture
def client() -> TestClient:
    # raise_server_exceptions=False: see the 500 the client gets instead of the test's traceback.
    return TestClient(make_app(), raise_server_exceptions=False, headers={"Authorization": "Bearer key-one"})


def assert_error(response, status_code: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status_code, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert "Traceback" not in response.text
    return error


def test_valid_request_passes(client):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "unknown_field": [1]})
    assert response.status_code == 200 and response.json() == {"ok": True}


def test_invalid_json(client):
    response = client.post(
        "/v1/completions", content=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"}
    )
    error = assert_error(response, 400)
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"null"])
def test_body_that_is_not_an_object(client, content):
    response = client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert "JSON object" in assert_error(response, 400)["message"]


def test_missing_body(client):
    assert_error(client.post("/v1/completions"), 400)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": MODEL, "prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ({"model": MODEL, "prompt": "x", "temperature": 9}, "temperature"),
    ],
)
def test_bad_completion_fields(client, body, param):
    error = assert_error(client.post("/v1/completions", json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(param + ":")


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role"),
    ],
)
def test_bad_chat_messages(client, messages, param):
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400, param=param)


def test_several_problems_in_one_message(client):
    error = assert_error(client.post("/v1/completions", json={"model": 1, "prompt": "", "n": 0}), 400, param="model")
    assert "prompt:" in error["message"] and "n:" in error["message"]


def test_pydantic_error_raised_by_a_route(client):
    assert_error(client.get("/manual"), 400, param="count")


def test_unknown_model(client):
    response = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert_error(response, 404, "model", "model_not_found")


def test_prompt_too_long(client):
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 101})
    error = assert_error(response, 400, "prompt", "context_length_exceeded")
    assert "101" in error["message"] and "100" in error["message"]


def test_queue_full_has_retry_after(client):
    response = client.get("/busy")
    assert_error(response, 429, code="queue_full")
    assert response.headers["Retry-After"] == "3"


def test_unavailable_says_when_to_retry(client):
    response = client.get("/down")
    error = assert_error(response, 503, code="unavailable")
    assert "controller" in error["message"] and int(response.headers["Retry-After"]) >= 1


def test_unknown_route_and_method(client):
    error = assert_error(client.get("/v2/nothing"), 404, code="not_found")
    assert "/v2/nothing" in error["message"]
    response = client.get("/v1/completions")
    assert_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["Allow"]


def test_unexpected_error_is_a_shaped_500_without_details(client, caplog):
    with caplog.at_level(logging.ERROR, logger="cluster.ingress.errors"):
        response = client.get("/bug")
    error = assert_error(response, 500, code="internal_error")
    assert "secret" not in response.text and "RuntimeError" not in response.text
    assert error["type"] == "internal_error"
    assert any(record.exc_info and isinstance(record.exc_info[1], RuntimeError) for record in caplog.records)


@pytest.mark.parametrize(
    "headers, is_allowed",
    [
        ({}, False),
        ({"Authorization": "Bearer wrong"}, False),
        ({"Authorization": "Basic key-one"}, False),
        ({"Authorization": "Bearer "}, False),
        ({"Authorization": "Bearer key-two"}, True),
        ({"Authorization": "bearer key-one"}, True),
    ],
)
def test_api_keys(headers, is_allowed):
    client = TestClient(make_app(), headers=headers)
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    if is_allowed:
        assert response.status_code == 200
    else:
        assert_error(response, 401, code="invalid_api_key")
        assert response.headers["WWW-Authenticate"] == "Bearer"


def test_no_keys_configured_means_open():
    client = TestClient(make_app(api_keys=frozenset()))
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 200
    errors.check_api_key(None, frozenset())


def test_body_over_limit_by_content_length(client):
    body = json.dumps({"model": MODEL, "prompt": "x" * MAX_BODY_BYTES}).encode()
    response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    error = assert_error(response, 413, code="body_too_large")
    assert str(MAX_BODY_BYTES) in error["message"]


def test_body_over_limit_when_chunked(client):
    def chunks():
        yield b'{"model": "smollm2", "prompt": "'
        for _ in range(MAX_BODY_BYTES // 512 + 1):
            yield b"y" * 512
        yield b'"}'

    # A generator body is sent with Transfer-Encoding: chunked and no Content-Length.
    response = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert_error(response, 413, code="body_too_large")


def test_chunked_body_under_limit_reaches_the_app(client):
    def chunks():
        yield b'{"model": "smollm2", '
        yield b'"prompt": "hello"}'

    response = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 200 and response.json() == {"ok": True}


async def run_asgi(app, body_chunks: list[bytes]) -> tuple[list[dict], list[bytes]]:
    """Drives an ASGI app with a chunked body, one receive() per chunk, as a server would."""
    incoming = [
        {"type": "http.request", "body": chunk, "more_body": index < len(body_chunks) - 1}
        for index, chunk in enumerate(body_chunks)
    ] + [{"type": "http.disconnect"}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"transfer-encoding", b"chunked")]}
    await app(scope, receive, send)
    return sent, incoming


def test_body_size_limit_counts_streamed_chunks():
    seen_bodies = []

    async def inner(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen_bodies.append(body)
        assert (await receive())["type"] == "http.disconnect"  # the live channel still reaches the app
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    guard = errors.BodySizeLimit(inner, max_body_bytes=100)
    sent, unread = asyncio.run(run_asgi(guard, [b"a" * 40, b"b" * 40, b"c" * 20]))
    assert seen_bodies == [b"a" * 40 + b"b" * 40 + b"c" * 20] and sent[0]["status"] == 200
    sent, unread = asyncio.run(run_asgi(guard, [b"a" * 40, b"b" * 40, b"c" * 21, b"d" * 40]))
    assert len(seen_bodies) == 1  # the app never saw the oversized request
    assert sent[0]["status"] == 413 and json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"
    assert len(unread) == 2  # it stopped reading at the chunk that crossed the limit


def test_body_size_limit_rejects_a_bad_limit():
    with pytest.raises(ValueError, match="max_body_bytes"):
        errors.BodySizeLimit(make_app(), max_body_bytes=0)
    with pytest.raises(ValueError, match="retry_after_s"):
        errors.queue_full(-1)


@pytest.mark.parametrize(
    "path, body, exception",
    [
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, openai.BadRequestError),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, openai.NotFoundError),
    ],
)
def test_official_client_raises_the_matching_exception(path, body, exception):
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="key-one", http_client=TestClient(make_app()), max_retries=0
    )
    with pytest.raises(exception) as exc_info:
        client.post(path.removeprefix("/v1"), body=body, cast_to=dict)
    assert exc_info.value.body["message"]


def test_official_client_authentication_error():
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=TestClient(make_app()))
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model=MODEL, prompt="x")
