"""The router's parsing of request bodies: what the protocol refuses is a 400 in OpenAI's words, and a handler
that fails with our bug is counted as the 500 the app answers."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from cluster.ingress.errors import APIError
from cluster.ingress.router import Router

RouterClass = Router.func_or_class  # the class under Serve's deployment wrapper
MODEL_ID = "smollm2"


async def _parse(body: dict, model_cls):
    async def read_body(request) -> bytes:
        return json.dumps(body).encode()

    return await RouterClass._parse(SimpleNamespace(_read_body=read_body), None, model_cls)


@pytest.mark.parametrize("body, param, message", [
    ({"model": MODEL_ID, "prompt": "Hi", "stream_options": {"include_usage": True}}, None,
     "stream_options is only allowed when stream is true"),  # a rule across fields: its own words, no field
    ({"model": MODEL_ID, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "messages[0].role: "),
])
def test_a_request_the_protocol_refuses_is_a_400_in_openai_words(body, param, message):
    from cluster.ingress import openai_protocol as protocol

    model_cls = protocol.ChatCompletionRequest if "messages" in body else protocol.CompletionRequest
    with pytest.raises(APIError) as raised:
        asyncio.run(_parse(body, model_cls))
    error = raised.value.body()["error"]
    assert raised.value.status_code == 400 and error["param"] == param
    assert error["message"].startswith(message) and "Value error" not in error["message"]


def test_a_handler_failing_with_our_bug_is_counted_as_the_500_the_app_answers():
    observed = []
    router = SimpleNamespace(metrics=SimpleNamespace(observe_status=observed.append))

    async def failing_handler():
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad vocabulary entry")

    with pytest.raises(UnicodeDecodeError):
        asyncio.run(RouterClass._counted(router, failing_handler()))
    assert observed == ["500"]


def test_the_client_request_id_is_the_body_field_else_the_header():
    from cluster.ingress.router import client_request_id

    assert client_request_id("trace-42", "body-1") == "body-1"  # Serve sets the header on every request
    assert client_request_id("trace-42", None) == "trace-42"
    assert client_request_id(None, "body-1") == "body-1" and client_request_id(None, None) is None
    for bad in ("", "has space", "x" * 257):
        with pytest.raises(APIError) as raised:
            client_request_id(bad, None)
        assert raised.value.status_code == 400 and raised.value.body()["error"]["param"] == "X-Request-Id"
