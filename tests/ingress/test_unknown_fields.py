"""Fields a request body carries that its model does not declare are named, logged once, and a 400 when strict."""

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.errors import APIError
from cluster.ingress.router import Router
from cluster.ingress.unknown_fields import UnknownFieldLog, unknown_fields

RouterClass = Router.func_or_class  # the class under Serve's deployment wrapper
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_undeclared_fields_are_named_by_their_path_at_every_depth():
    body = {**CHAT, "reasoning_budget": 5, "stream": True, "stream_options": {"include_usage": True, "more": 1},
            "messages": [{"role": "user", "content": "hi", "nick": "ann"},
                         {"role": "assistant", "content": "yo", "thought": "hm", "name": "bot"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x": 1},
                       "cache_control": {}}]}
    assert unknown_fields(body, protocol.ChatCompletionRequest) == [
        "messages[].nick", "messages[].thought", "reasoning_budget", "stream_options.more",
        "tools[].cache_control", "tools[].function.x"]
    assert unknown_fields({"model": "m", "prompt": "hi", "suffix": None, "top_k": 3},
                          protocol.CompletionRequest) == []  # declared, whatever they do
    assert unknown_fields({"model": "m", "prompt": "hi", "messages": []}, protocol.CompletionRequest) == ["messages"]
    assert unknown_fields([1, 2], protocol.CompletionRequest) == []  # not an object: validation refuses it


def test_every_declared_field_is_known():
    for model_cls in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        assert unknown_fields({name: None for name in model_cls.model_fields}, model_cls) == []


def _router(strict: bool) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(strict_request_fields=strict), unknown_field_log=UnknownFieldLog())


def test_the_router_parses_a_body_into_its_request_and_the_fields_it_ignores():
    async def read_body(request) -> bytes:
        return json.dumps({**CHAT, "thinking": {"type": "enabled"}}).encode()

    req, unknown = asyncio.run(RouterClass._parse(SimpleNamespace(_read_body=read_body), None,
                                                  protocol.ChatCompletionRequest))
    assert req.messages[0].content == "hi" and unknown == ["thinking"]


def test_strict_request_fields_refuses_them_with_a_400_naming_them():
    with pytest.raises(APIError) as raised:
        RouterClass._check_unknown(_router(strict=True), ["messages[].name", "thinking"])
    error = raised.value.body()["error"]
    assert raised.value.status_code == 400 and error["param"] == "messages[].name"
    assert "messages[].name, thinking" in error["message"] and "strict_request_fields" in error["message"]
    RouterClass._check_unknown(_router(strict=True), [])  # nothing unknown: served


def test_without_it_each_name_is_logged_once(caplog):
    router = _router(strict=False)
    with caplog.at_level(logging.WARNING, logger="cluster.ingress.router"):
        RouterClass._check_unknown(router, ["thinking"])
        RouterClass._check_unknown(router, ["thinking", "verbosity_level"])
        RouterClass._check_unknown(router, ["thinking"])
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 2 and "'thinking'" in logged[0] and "'verbosity_level'" in logged[1]
    assert "x-s3-ignored-fields" in logged[0]


def test_the_header_carries_only_printable_short_names_and_counts_the_rest():
    from cluster.ingress.unknown_fields import MAX_HEADER_NAMES, header_value

    assert header_value(["a", "b"]) == "a, b"
    assert header_value(["ok", "é", "x\r\ny", "z" * 65]) == "ok, +3 more"  # never echoed raw into a header
    many = [f"f{i}" for i in range(MAX_HEADER_NAMES + 4)]
    assert header_value(many).endswith(f"f{MAX_HEADER_NAMES - 1}, +4 more")
    log = UnknownFieldLog()
    assert log.first_seen(["x\r\ny", "a", "a"]) == ["(a name of 4 characters, not shown)", "a"]
