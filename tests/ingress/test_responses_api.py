"""OpenAI's Responses API over the chat endpoint (scripted worker streams, no Ray): whole and streamed responses in
the openai package's own types, function calls both ways, a cut answer, and what a stateless server refuses."""

import asyncio
import copy
import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter, ValidationError

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.responses_api import ResponsesRequest, chat_body, response_events, response_from_chat
from test_completions import ScriptedWorkers, make_completions  # noqa: F401 (fixture)

MODEL = "smollm2"
WEATHER = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture
def hermes_template_tokenizer(smollm2_tokenizer):
    from test_tool_calls import HERMES_TEMPLATE

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def _run(tokenizer, said: str, body: dict, parser: str | None = None):
    req = ResponsesRequest.model_validate({"model": MODEL, **body})
    workers = ScriptedWorkers(tokenizer(said, add_special_tokens=False)["input_ids"])
    completions = make_completions(tokenizer, workers, reasoning_parser=parser)[0]
    chat_req = protocol.ChatCompletionRequest.model_validate(chat_body(req))

    async def run():
        chat = await completions.answer(chat_req, True)
        if not req.stream:
            return response_from_chat(req, json.loads(chat.body))
        events = [event async for event in response_events(req, chat.body_iterator)]
        await chat.on_close()
        return [json.loads(event.decode().split("data: ", 1)[1]) for event in events]

    return asyncio.run(run()), workers


def test_a_text_answer_whole_and_streamed(smollm2_tokenizer):
    body = {"input": "Capital of France?", "instructions": "Be brief.", "max_output_tokens": 20}
    whole, workers = _run(smollm2_tokenizer, "Paris.", body)
    response = Response.model_validate(whole)
    assert response.status == "completed" and response.output_text == "Paris."
    assert response.usage.output_tokens == len(smollm2_tokenizer("Paris.", add_special_tokens=False)["input_ids"])
    prompt = smollm2_tokenizer.decode(workers.jobs[0].prompt_token_ids)
    assert "Be brief." in prompt and "Capital of France?" in prompt
    events, _ = _run(smollm2_tokenizer, "Paris.", {**body, "stream": True})
    parsed = [EVENTS.validate_python(event) for event in events]
    assert [event.sequence_number for event in parsed] == list(range(len(parsed)))
    assert parsed[0].type == "response.created" and parsed[-1].type == "response.completed"
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "Paris."
    assert parsed[-1].response.output_text == "Paris." and parsed[-1].response.usage.output_tokens > 0


def test_function_calls_out_and_their_results_back_in(smollm2_tokenizer):
    body = {"input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"},
            "max_output_tokens": 30}
    whole, _ = _run(smollm2_tokenizer, '{"city": "Paris"}', body)
    call = Response.model_validate(whole).output[0]
    assert call.type == "function_call" and call.name == "weather" and json.loads(call.arguments) == {"city": "Paris"}
    events, _ = _run(smollm2_tokenizer, '{"city": "Paris"}', {**body, "stream": True})
    done = [EVENTS.validate_python(e) for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    fragments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(fragments) > 1 and "".join(fragments) == done[0].arguments  # streamed as the model wrote them
    follow_up = ResponsesRequest.model_validate({"model": MODEL, "tools": [WEATHER], "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Ask."}]},
        {"type": "function_call", "call_id": call.call_id, "name": "weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]})
    messages = chat_body(follow_up)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id and messages[1]["reasoning_content"] == "Ask."
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 24 C"}


def test_thinking_is_a_reasoning_item_and_a_cut_answer_is_incomplete(smollm2_tokenizer):
    whole, _ = _run(smollm2_tokenizer, "<think>Easy.</think>Paris.", {"input": "Capital?"}, parser="qwen3")
    response = Response.model_validate(whole)
    assert [item.type for item in response.output] == ["reasoning", "message"] and response.output_text == "Paris."
    assert response.output[0].content[0].text == "Easy."
    cut, _ = _run(smollm2_tokenizer, "Paris is the capital of France.", {"input": "Capital?", "max_output_tokens": 2})
    response = Response.model_validate(cut)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("body, words", [
    ({"input": "x", "store": True}, "keeps no responses"),
    ({"input": "x", "previous_response_id": "resp_1"}, "keeps no responses"),
])
def test_what_a_stateless_server_cannot_do_is_refused_by_name(body, words):
    with pytest.raises(ValidationError, match=words):
        ResponsesRequest.model_validate({"model": MODEL, **body})


def test_tools_other_than_functions_and_unknown_items_are_refused():
    with pytest.raises(ValueError, match="'web_search' are not supported"):
        chat_body(ResponsesRequest.model_validate({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}))
    with pytest.raises(ValueError, match="'image_generation_call' are not supported"):
        chat_body(ResponsesRequest.model_validate({"model": MODEL, "input": [{"type": "image_generation_call"}]}))


def test_a_text_item_closes_before_a_call_item_opens(hermes_template_tokenizer):
    said = 'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    events, _ = _run(hermes_template_tokenizer, said, {"input": "Weather?", "tools": [WEATHER], "stream": True})
    kinds = [(e["type"], e.get("output_index")) for e in events if e["type"].startswith("response.output_item")]
    assert kinds == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1)]
    assert EVENTS.validate_python(events[-1]).response.output[1].name == "weather"
