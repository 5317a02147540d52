"""The router's response bodies from a generation's token stream: `created`, the first chat chunk, and a
generation that fails after its first tokens (a 503 to retry, as a stream reports in-band), and a detokenizer
that fails (our bug: a 500)."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from cluster.ingress.errors import APIError
from cluster.ingress.generation import GenerationJob, GenerationResult
from cluster.ingress.router import Router
from workers.sampling_params import SamplingParams

RouterClass = Router.func_or_class  # the class under Serve's deployment wrapper
MODEL_ID = "smollm2"


def fake_router(tokenizer) -> SimpleNamespace:
    observed = []
    return SimpleNamespace(tokenizer=tokenizer, num_in_flight=1, config=SimpleNamespace(model_id=MODEL_ID),
                           metrics=SimpleNamespace(observe_status=lambda status: observed.append(status)),
                           _observe=lambda job, result, start_s: observed.append("ok"), observed=observed)


def make_job(tokenizer, text: str = "Hi") -> GenerationJob:
    ids = tuple(tokenizer.encode(text))
    return GenerationJob("chatcmpl-1", text, ids, SamplingParams(max_tokens=8), 8, 8)


async def token_stream(chunks: list[list[int]], result: GenerationResult, error: Exception | None = None):
    for chunk in chunks:
        result.output_token_ids.extend(chunk)
        yield chunk
    if error is not None:
        raise error
    result.finish_reason = "stop"


def test_a_collected_response_is_created_when_its_request_started(smollm2_tokenizer):
    router, result = fake_router(smollm2_tokenizer), GenerationResult([])
    ids = smollm2_tokenizer.encode(" Paris is the capital.")
    start_s, before_s = time.monotonic() - 30.0, int(time.time()) - 30  # the request came 30 s ago
    body = asyncio.run(RouterClass._collect(router, False, make_job(smollm2_tokenizer), token_stream([ids[1:]], result),
                                            ids[:1], result, start_s))
    assert body["choices"][0]["text"] == " Paris is the capital."
    assert before_s <= body["created"] <= int(time.time()) - 29
    assert router.num_in_flight == 0 and router.observed == ["ok"]


def test_a_generation_that_fails_after_its_first_tokens_is_a_503(smollm2_tokenizer):
    router, result = fake_router(smollm2_tokenizer), GenerationResult([])
    ids = smollm2_tokenizer.encode(" one two three")
    stream = token_stream([ids[1:2]], result, RuntimeError("the worker reported an error"))
    with pytest.raises(APIError) as raised:
        asyncio.run(RouterClass._collect(router, True, make_job(smollm2_tokenizer), stream, ids[:1], result,
                                         time.monotonic()))
    assert raised.value.status_code == 503
    assert "RuntimeError" in raised.value.body()["error"]["message"]
    assert router.num_in_flight == 0 and router.observed == []  # counted by status where it is answered


def test_a_detokenizer_failure_is_our_error_not_a_503_to_retry(smollm2_tokenizer):
    """The generation succeeded; retrying it would fail the same way, so the error reaches the app's handler
    (a 500 internal_error) instead of being answered as a worker that went away."""

    class BrokenDecode:
        def encode(self, text):
            return smollm2_tokenizer.encode(text)

        def decode(self, ids, **kwargs):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad vocabulary entry")

    router, result = fake_router(BrokenDecode()), GenerationResult([])
    ids = smollm2_tokenizer.encode(" one two")
    with pytest.raises(UnicodeDecodeError):
        asyncio.run(RouterClass._collect(router, False, make_job(smollm2_tokenizer), token_stream([ids[1:]], result),
                                         ids[:1], result, time.monotonic()))
    assert router.num_in_flight == 0 and router.observed == []

    async def failing_handler():
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad vocabulary entry")

    with pytest.raises(UnicodeDecodeError):  # the route counts it as the 500 the app's handler answers
        asyncio.run(RouterClass._counted(router, failing_handler()))
    assert router.observed == ["500"]


def test_a_chat_stream_opens_with_the_role_and_empty_content(smollm2_tokenizer):
    router, result = fake_router(smollm2_tokenizer), GenerationResult([])
    ids = smollm2_tokenizer.encode(" Hello there")
    req = SimpleNamespace(include_usage=False)

    async def events() -> list[bytes]:
        return [event async for event in RouterClass._sse(router, req, True, make_job(smollm2_tokenizer),
                                                           token_stream([ids[1:]], result), ids[:1], result,
                                                           time.monotonic() - 30.0)]

    received = asyncio.run(events())
    chunks = [json.loads(event[len(b"data: "):]) for event in received[:-1]]
    assert received[-1] == b"data: [DONE]\n\n"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " Hello there"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert {c["created"] for c in chunks} == {chunks[0]["created"]}  # the request's start, 30 s ago
    assert int(time.time()) - 31 <= chunks[0]["created"] <= int(time.time()) - 29


async def _parse(body: dict, model_cls):
    async def read_body(request) -> bytes:
        return json.dumps(body).encode()

    return await RouterClass._parse(SimpleNamespace(_read_body=read_body), None, model_cls)


@pytest.mark.parametrize("body, param, message", [
    ({"model": MODEL_ID, "prompt": "Hi", "stream_options": {"include_usage": True}}, None,
     "stream_options is only allowed when stream is true"),  # a rule across fields: its own words, no field
    ({"model": MODEL_ID, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "messages[0].role: "),
])
def test_a_request_the_protocol_refuses_is_a_400_in_openai_words(body, param, message):
    from cluster.ingress import openai_protocol as protocol

    model_cls = protocol.ChatCompletionRequest if "messages" in body else protocol.CompletionRequest
    with pytest.raises(APIError) as raised:
        asyncio.run(_parse(body, model_cls))
    error = raised.value.body()["error"]
    assert raised.value.status_code == 400 and error["param"] == param
    assert error["message"].startswith(message) and "Value error" not in error["message"]


def test_chat_with_a_model_that_has_no_template_is_a_400_and_a_template_file_fixes_it(smollm2_dir, tmp_path):
    from cluster.ingress.openai_protocol import ChatCompletionRequest
    from workers.models import load_tokenizer

    chat = ChatCompletionRequest.model_validate({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}]})
    base = load_tokenizer(smollm2_dir)
    base.chat_template = None  # as a base model's tokenizer comes
    with pytest.raises(APIError) as raised:
        RouterClass._encode_prompt(fake_router(base), chat, True)
    assert raised.value.status_code == 400 and "no chat template" in str(raised.value.message)
    assert "--chat-template" in str(raised.value.message)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    templated = load_tokenizer(smollm2_dir, str(template))
    text, ids = RouterClass._encode_prompt(fake_router(templated), chat, True)
    assert templated.decode(ids) == "user: Hi\nassistant:"
