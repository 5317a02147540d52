"""Request models and response payloads against OpenAI's own types and client (no Ray, no model)."""

import json

import fastapi
import openai
import pytest
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from cluster.ingress import openai_protocol as proto
from cluster.ingress.errors import install_error_handlers

MODEL = "smollm2"
CREATED_S = 1_700_000_000


def completion(**fields) -> proto.CompletionRequest:
    return proto.CompletionRequest.model_validate({"model": MODEL, "prompt": "Hello", **fields})


def chat(**fields) -> proto.ChatCompletionRequest:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}
    return proto.ChatCompletionRequest.model_validate(body)


def error_fields(exc_info) -> list[str]:
    return [".".join(str(part) for part in error["loc"]) for error in exc_info.value.errors()]


def test_completion_request_defaults_and_prompt_forms():
    req = completion()
    assert (req.max_tokens, req.temperature, req.top_p, req.n, req.stream) == (None, 1.0, 1.0, 1, False)
    assert (req.stop_sequences, req.seed, req.ignore_eos, req.include_usage) == ((), None, False, False)
    assert proto.prompts(req) == ["Hello"]
    assert proto.prompts(completion(prompt=["Only one"])) == ["Only one"]
    assert proto.prompts(completion(prompt=["a", "b"])) == ["a", "b"]  # several prompts, each with n choices
    for prompt in ([5, 0, 17], [[5, 0, 17]]):  # token ids, alone or in a list (OpenAI's forms)
        assert proto.prompts(completion(prompt=prompt)) == [[5, 0, 17]]
    assert proto.prompts(completion(prompt=[[5], [6, 7]])) == [[5], [6, 7]]
    assert proto.requested_max_tokens(completion(max_tokens=7)) == 7


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"),
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": [""]}, "prompt"),
        ({"prompt": [1, -2, 3]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 65}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ""}, "stop"),
        ({"stop": [f"s{i}" for i in range(proto.MAX_STOP_SEQUENCES + 1)]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"echo": "yes"}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"best_of": 0}, "best_of"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"logit_bias": {"50": 101}}, "logit_bias.50"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"guided_regex": 5}, "guided_regex"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"model": 5}, "model"),
        ({"priority": 101}, "priority"),
        ({"priority": -101}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"priority": 1.5}, "priority"),
    ],
)
def test_completion_request_rejects(fields, field):
    with pytest.raises(ValidationError) as exc_info:
        completion(**fields)
    assert error_fields(exc_info)[0] == field


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": 0}, "max_tokens 0 is only allowed with echo"),
    ({"n": 3, "best_of": 2}, "best_of \\(2\\) must be at least n \\(3\\)"),
    ({"best_of": 2, "stream": True}, "best_of above n cannot be streamed"),
    ({"prompt": ["a", "b", "c"], "n": 22}, "over 64 sequences per request"),
    ({"prompt": ["a", "b"], "n": 2, "best_of": 40}, "over 64 sequences per request"),
])
def test_choices_that_cannot_be_served_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        completion(**fields)


def test_scoring_and_choices_are_read():
    req = completion(prompt=["a", "b"], max_tokens=0, echo=True, logprobs=3, n=2, best_of=4)
    assert (req.max_tokens, req.echo, req.logprobs, req.n, req.best_of) == (0, True, 3, 2, 4)
    assert (chat(logprobs=True, top_logprobs=5).top_logprobs, chat(logprobs=None).logprobs) == (5, False)
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs set to true"):
        chat(top_logprobs=2)
    assert completion(n=2, best_of=2, stream=True).best_of == 2  # nothing to rank: streamed as n
    assert chat(top_logprobs=0).top_logprobs == 0  # the default, sent alone


def test_stream_options_need_stream():
    with pytest.raises(ValidationError, match="only allowed when stream is true"):
        completion(stream_options={"include_usage": True})
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_defaults_sent_explicitly_and_unknown_fields_are_accepted():
    req = completion(
        echo=False, logprobs=None, best_of=1, presence_penalty=0, frequency_penalty=0.0, stop=["\n", "END"],
        temperature=0, seed=-3, some_future_field={"x": 1},
    )
    assert req.stop_sequences == ("\n", "END")
    assert req.temperature == 0.0
    assert not hasattr(req, "some_future_field")


def test_humaneval_style_five_stop_strings_are_accepted():
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]  # what lm-eval's HumanEval task sends
    assert completion(stop=stops).stop_sequences == tuple(stops)


@pytest.mark.parametrize("build", [completion, chat])
def test_null_means_the_default_where_openai_allows_null(build):
    # openai-python sends `"temperature": null` when code passes temperature=None; vLLM takes it as the default.
    req = build(temperature=None, top_p=None, n=None, stream=None, stop=None, seed=None, max_tokens=None)
    assert (req.temperature, req.top_p, req.n, req.stream, req.stop_sequences) == (1.0, 1.0, 1, False, ())


@pytest.mark.parametrize("build", [completion, chat])
def test_openai_penalties_and_vllm_sampling_extras_are_read(build):
    req = build(top_k=5, min_p=0.1, repetition_penalty=1.2, min_tokens=4, stop_token_ids=[2, 7],
                presence_penalty=0.5, frequency_penalty=-1, logit_bias={"17": -100, "3": 2.5})
    assert (req.top_k, req.min_p, req.repetition_penalty, req.min_tokens, req.stop_token_ids) == (5, 0.1, 1.2, 4,
                                                                                                 [2, 7])
    assert (req.presence_penalty, req.frequency_penalty) == (0.5, -1.0)
    assert req.logit_bias_pairs == ((3, 2.5), (17, -100.0))


@pytest.mark.parametrize("build", [completion, chat])
@pytest.mark.parametrize(
    "field, default, value",
    [("guided_whitespace_pattern", None, " *"),
     ("use_beam_search", False, True),
     ("allowed_token_ids", None, [1, 2]), ("bad_words", [], ["x"])],
)
def test_vllm_extras_we_do_not_serve_are_refused_unless_left_at_their_default(build, field, default, value):
    # Clients moving from vLLM send these through extra_body: dropping them would change answers unnoticed.
    assert build(**{field: default})
    with pytest.raises(ValidationError, match=f"'{field}' is not supported") as exc_info:
        build(**{field: value})
    assert error_fields(exc_info)[0] == field


def test_chat_request_messages_and_max_tokens():
    req = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"},
            {"role": "assistant", "content": "ok"},
        ],
        max_completion_tokens=12,
    )
    assert proto.chat_messages(req) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "u"},  # the name goes to the template, as vLLM hands it
        {"role": "assistant", "content": "ok"},
    ]
    assert proto.requested_max_tokens(req) == 12
    assert proto.requested_max_tokens(chat(max_tokens=5)) == 5
    assert proto.requested_max_tokens(chat(max_tokens=5, max_completion_tokens=5)) == 5
    assert proto.requested_max_tokens(chat()) is None


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
        ({"messages": "hi"}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"guided_grammar": ["root"]}, "guided_grammar"),
    ],
)
def test_chat_request_rejects(fields, field):
    with pytest.raises(ValidationError) as exc_info:
        chat(**fields)
    assert error_fields(exc_info)[0] == field


def test_chat_rejects_conflicting_max_tokens():
    with pytest.raises(ValidationError, match="differ"):
        chat(max_tokens=5, max_completion_tokens=6)


def test_completion_payloads_parse_as_openai_types():
    choices = [proto.completion_choice(0, "Hi there", "length")]
    body = proto.completion_response("abc", MODEL, choices, proto.usage(4, 2), CREATED_S)
    parsed = Completion.model_validate(body)
    assert parsed.id == "cmpl-abc" and parsed.object == "text_completion"
    assert parsed.choices[0].text == "Hi there" and parsed.choices[0].finish_reason == "length"
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (4, 2, 6)
    # An id that already has the prefix keeps it once.
    assert proto.completion_response("cmpl-x", MODEL, [], proto.usage(1, 0), CREATED_S)["id"] == "cmpl-x"
    final = Completion.model_validate(proto.completion_chunk("abc", MODEL, "!", "stop", CREATED_S))
    assert final.choices[0].text == "!" and final.choices[0].finish_reason == "stop" and final.usage is None
    # OpenAI streams finish_reason null until the last chunk, although openai.types.Completion
    # declares it non-null (the client builds stream chunks without validation): the other
    # chunks differ from the last one in that field only, and in vLLM's stop_reason, which the last one adds.
    middle = proto.completion_chunk("abc", MODEL, "!", None, CREATED_S)
    assert middle["choices"][0]["finish_reason"] is None
    assert {**middle, "choices": [{**middle["choices"][0], "finish_reason": "stop", "stop_reason": None}]} == \
        final.model_dump(
        exclude_unset=True
    )
    last = Completion.model_validate(proto.completion_usage_chunk("abc", MODEL, CREATED_S, proto.usage(4, 2)))
    assert last.choices == [] and last.usage.total_tokens == 6


def test_chat_payloads_parse_as_openai_types():
    body = proto.chat_response("abc", MODEL, [proto.chat_choice(0, "Hello!", "stop")], proto.usage(9, 3), CREATED_S)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.id == "chatcmpl-abc" and parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant" and parsed.choices[0].message.content == "Hello!"
    assert parsed.usage.total_tokens == 12
    first = ChatCompletionChunk.model_validate(proto.chat_chunk("abc", MODEL, "", None, CREATED_S, role="assistant"))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    middle = ChatCompletionChunk.model_validate(proto.chat_chunk("abc", MODEL, "lo", None, CREATED_S))
    assert middle.choices[0].delta.content == "lo" and middle.choices[0].delta.role is None
    end = ChatCompletionChunk.model_validate(proto.chat_chunk("abc", MODEL, None, "stop", CREATED_S))
    assert end.choices[0].finish_reason == "stop" and end.choices[0].delta.content is None
    last = ChatCompletionChunk.model_validate(proto.chat_usage_chunk("abc", MODEL, CREATED_S, proto.usage(9, 3)))
    assert last.choices == [] and last.usage.completion_tokens == 3


def test_models_and_sse():
    body = proto.models_response([MODEL, "other"], CREATED_S)
    assert body["object"] == "list"
    assert [Model.model_validate(entry).id for entry in body["data"]] == [MODEL, "other"]
    assert "max_model_len" not in body["data"][0]
    assert proto.models_response([MODEL], CREATED_S, 8192)["data"][0]["max_model_len"] == 8192  # as vLLM's
    event = proto.sse_event({"text": "é\n"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n\n") == 1
    assert json.loads(event[len(b"data: ") : -2]) == {"text": "é\n"}
    assert proto.SSE_DONE == b"data: [DONE]\n\n"


def make_echo_app() -> fastapi.FastAPI:
    """A server that 'generates' the prompt's words back, one per token, through our payloads."""
    app = fastapi.FastAPI()
    install_error_handlers(app)

    def words(text: str, max_tokens: int | None) -> tuple[list[str], str]:
        tokens = [word + " " for word in text.split()]
        limit = max_tokens if max_tokens is not None else len(tokens)
        return tokens[:limit], "length" if limit < len(tokens) else "stop"

    @app.post("/v1/completions")
    async def completions(req: proto.CompletionRequest):
        tokens, finish_reason = words(proto.prompts(req)[0], proto.requested_max_tokens(req))
        if not req.stream:
            choice = proto.completion_choice(0, "".join(tokens), finish_reason)
            return proto.completion_response("r1", req.model, [choice], proto.usage(3, len(tokens)), CREATED_S)

        async def events():
            for index, token in enumerate(tokens):
                is_last = index == len(tokens) - 1
                chunk = proto.completion_chunk("r1", req.model, token, finish_reason if is_last else None, CREATED_S)
                yield proto.sse_event(chunk)
            if req.include_usage:
                final_usage = proto.usage(3, len(tokens))
                yield proto.sse_event(proto.completion_usage_chunk("r1", req.model, CREATED_S, final_usage))
            yield proto.SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: proto.ChatCompletionRequest):
        tokens, finish_reason = words(proto.chat_messages(req)[-1]["content"], proto.requested_max_tokens(req))
        if not req.stream:
            choice = proto.chat_choice(0, "".join(tokens), finish_reason)
            return proto.chat_response("r2", req.model, [choice], proto.usage(5, len(tokens)), CREATED_S)

        async def events():
            yield proto.sse_event(proto.chat_chunk("r2", req.model, "", None, CREATED_S, role="assistant"))
            for token in tokens:
                yield proto.sse_event(proto.chat_chunk("r2", req.model, token, None, CREATED_S))
            yield proto.sse_event(proto.chat_chunk("r2", req.model, None, finish_reason, CREATED_S))
            if req.include_usage:
                yield proto.sse_event(proto.chat_usage_chunk("r2", req.model, CREATED_S, proto.usage(5, len(tokens))))
            yield proto.SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return proto.models_response([MODEL], CREATED_S)

    return app


@pytest.fixture
def client() -> openai.OpenAI:
    # TestClient is an httpx.Client, so the official client talks to the app in process.
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=TestClient(make_echo_app()))


def test_official_client_completions(client):
    result = client.completions.create(model=MODEL, prompt="one two three", max_tokens=2)
    assert result.choices[0].text == "one two " and result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 2
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="one two three", stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == "one two three "
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 6


def test_official_client_chat(client):
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "a b c"}]
    result = client.chat.completions.create(model=MODEL, messages=messages)
    assert result.choices[0].message.content == "a b c " and result.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "a b "
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    assert [model.id for model in client.models.list()] == [MODEL]


def test_official_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc_info:
        client.completions.create(model=MODEL, prompt="x", n=0)
    assert exc_info.value.status_code == 400
    assert exc_info.value.body["param"] == "n"


def test_priority_defaults_to_zero_and_is_read_on_both_endpoints():
    assert completion().priority == 0
    assert completion(priority=-3).priority == -3
    chat = proto.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], priority=7)
    assert chat.priority == 7
