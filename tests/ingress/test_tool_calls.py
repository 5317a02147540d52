"""Tools on the chat endpoint over scripted worker streams: a named or required call is generated under its schema
and answered in OpenAI's `tool_calls` shape (streamed too, read with the openai package's own types), "auto" reads
calls in a template's Hermes format and says why a model without one cannot, and earlier calls and tool results are
accepted as messages."""

import copy
import json

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from test_completions import ScriptedWorkers, answer, answer_ids, make_completions, stream  # noqa: F401 (fixture)

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.errors import APIError
from cluster.ingress.tool_calls import template_messages

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time_in"}}
ASK = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME], "max_tokens": 40}


def _workers(tokenizer, text: str) -> ScriptedWorkers:
    return ScriptedWorkers(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_named_function_is_answered_as_its_call(smollm2_tokenizer):
    workers = _workers(smollm2_tokenizer, '{"city": "Paris"}')
    completions, _ = make_completions(smollm2_tokenizer, workers)
    named = {"type": "function", "function": {"name": "weather"}}
    body = answer(completions, {**ASK, "tool_choice": named}, is_chat=True)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    job_grammar = json.loads(workers.jobs[0].params.grammar.text)
    assert job_grammar == WEATHER["function"]["parameters"]  # generated under the function's own schema


def test_a_required_call_picks_its_function_and_streams_in_openais_shape(smollm2_tokenizer):
    text = '{"name": "weather", "arguments": {"city": "Paris"}}'
    workers = _workers(smollm2_tokenizer, text)
    completions, _ = make_completions(smollm2_tokenizer, workers)
    body = answer(completions, {**ASK, "tool_choice": "required"}, is_chat=True)
    choice = ChatCompletion.model_validate(body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "weather"
    grammar = workers.jobs[0].params.grammar  # a list of one or more calls, as OpenAI's parallel calls by default
    assert grammar.format == "grammar" and grammar.text.startswith('start: "[" call (", " call)* "]"\ncall: call0 | call1')
    assert '"{\\"name\\": \\"weather\\", \\"arguments\\": "' in grammar.text  # one alternative per function
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream(completions, {**ASK, "tool_choice": "required"},
                                                                    is_chat=True)]
    deltas = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].function.name == "weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > 2 and all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Paris"}  # fragments as they came
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)  # the call, not its JSON as text


def test_auto_says_the_model_has_no_tool_format_and_none_answers_in_text(smollm2_tokenizer, answer_ids):
    completions, _ = make_completions(smollm2_tokenizer, ScriptedWorkers(answer_ids))
    with pytest.raises(APIError) as raised:
        answer(completions, ASK, is_chat=True)  # tools without tool_choice: "auto"
    assert raised.value.status_code == 400 and "it has no tool-call format" in raised.value.message
    body = answer(completions, {**ASK, "tool_choice": "none"}, is_chat=True)
    assert body["choices"][0]["message"]["content"] and "tool_calls" not in body["choices"][0]["message"]
    for bad, words in (({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "naming one of tools"),
                       ({"tool_choice": "sometimes"}, "tool_choice must be"),
                       ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
                       ({"tool_choice": "required", "guided_regex": "x"}, "set one structured-output constraint")):
        with pytest.raises(APIError, match=words):
            answer(completions, {**ASK, **bad}, is_chat=True)


def test_earlier_calls_and_tool_results_reach_the_template_as_text(smollm2_tokenizer):
    req = protocol.ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER], "tool_choice": "required",
                                                         "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]})
    messages, tools = template_messages(req, protocol.chat_messages(req), smollm2_tokenizer)
    assert tools is None  # SmolLM2's template takes no tools: they are listed in a system message
    assert messages[0]["role"] == "system" and '"name": "weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '{"name": "weather", "arguments": {"city": "Paris"}}'}
    assert messages[3] == {"role": "user", "content": "The call returned: 18 C, sunny"}
    with pytest.raises(ValueError, match="only assistant messages carry tool_calls"):
        protocol.ChatMessage.model_validate({"role": "user", "content": "x", "tool_calls": [{"function": {}}]})
    with pytest.raises(ValueError, match="content is required"):
        protocol.ChatMessage.model_validate({"role": "user", "content": None})


HERMES_TEMPLATE = (  # the shape of Qwen's and Hermes' templates: tools in the system turn, calls in <tool_call> tags
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}. Call one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] or '' }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.fixture
def hermes_tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def test_auto_reads_calls_in_the_templates_own_format(hermes_tokenizer):
    said = 'Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    workers = _workers(hermes_tokenizer, said)
    completions, _ = make_completions(hermes_tokenizer, workers)
    choice = ChatCompletion.model_validate(answer(completions, ASK, is_chat=True)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    assert choice.message.tool_calls[0].function.name == "weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    prompt = hermes_tokenizer.decode(workers.jobs[0].prompt_token_ids)
    assert '"name": "weather"' in prompt and workers.jobs[0].params.grammar is None  # the model decides, freely
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream(completions, ASK, is_chat=True)]
    calls = [call for c in chunks for call in (c.choices[0].delta.tool_calls or [])]
    assert [call.function.name for call in calls if call.id] == ["weather"]
    assert "".join(call.function.arguments for call in calls) == choice.message.tool_calls[0].function.arguments
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look.\n"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_a_text_answer_and_an_unread_format_is_a_400(hermes_tokenizer, smollm2_tokenizer):
    completions, _ = make_completions(hermes_tokenizer, _workers(hermes_tokenizer, "It is sunny in Paris."))
    message = answer(completions, ASK, is_chat=True)["choices"][0]["message"]
    assert message["content"] == "It is sunny in Paris." and "tool_calls" not in message
    other = copy.deepcopy(smollm2_tokenizer)
    other.chat_template = HERMES_TEMPLATE.replace("<tool_call>", "[CALL]").replace("</tool_call>", "[/CALL]")
    completions, _ = make_completions(other, _workers(other, "x"))
    with pytest.raises(APIError, match="no --tool-call-parser is set"):
        answer(completions, ASK, is_chat=True)


def test_required_answers_parallel_calls_and_one_call_without_them(smollm2_tokenizer):
    said = '[{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "time_in", "arguments": {}}]'
    completions, _ = make_completions(smollm2_tokenizer, _workers(smollm2_tokenizer, said))
    choice = answer(completions, {**ASK, "tool_choice": "required", "max_tokens": 60}, is_chat=True)["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == [("weather", {"city": "Paris"}), ("time_in", {})] and choice["finish_reason"] == "tool_calls"
    chunks = stream(completions, {**ASK, "tool_choice": "required", "max_tokens": 60}, is_chat=True)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert [(d["index"], d["function"]["name"]) for d in deltas if "id" in d] == [(0, "weather"), (1, "time_in")]
    assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == 0) == '{"city": "Paris"}'
    cut = answer(completions, {**ASK, "tool_choice": "required", "max_tokens": 20}, is_chat=True)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["name"] == "weather"
    workers = _workers(smollm2_tokenizer, '{"name": "weather", "arguments": {"city": "Paris"}}')
    completions, _ = make_completions(smollm2_tokenizer, workers)
    one = answer(completions, {**ASK, "tool_choice": "required", "parallel_tool_calls": False}, is_chat=True)
    assert workers.jobs[0].params.grammar.text.startswith("start: call0 | call1\n")  # exactly one call
    assert [c["function"]["name"] for c in one["choices"][0]["message"]["tool_calls"]] == ["weather"]


def test_required_keeps_each_schema_whole_so_its_refs_resolve(smollm2_tokenizer):
    from cluster.ingress.tool_calls import tool_grammar
    from workers.values.grammar import check_grammar

    nested = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"guest": {"$ref": "#/$defs/Guest"}}, "required": ["guest"],
        "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}}}
    req = protocol.ChatCompletionRequest.model_validate({**ASK, "model": "m", "tools": [nested, WEATHER],
                                                         "tool_choice": "required"})
    spec = tool_grammar(req)
    check_grammar(spec)  # compiles: the $ref resolves inside its own schema
    workers = _workers(smollm2_tokenizer, '{"name": "book", "arguments": {"guest": {"name": "Ada"}}}')
    completions, _ = make_completions(smollm2_tokenizer, workers)
    body = answer(completions, {**ASK, "tools": [nested, WEATHER], "tool_choice": "required"}, is_chat=True)
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "book" and json.loads(call["arguments"]) == {"guest": {"name": "Ada"}}


def test_a_call_cut_by_the_limit_finishes_length_and_parallel_false_keeps_one(hermes_tokenizer, smollm2_tokenizer):
    completions, _ = make_completions(smollm2_tokenizer, _workers(smollm2_tokenizer, '{"city": "Paris"}'))
    named = {"type": "function", "function": {"name": "weather"}}
    body = answer(completions, {**ASK, "tool_choice": named, "max_tokens": 3}, is_chat=True)
    assert body["choices"][0]["finish_reason"] == "length"
    cut = body["choices"][0]["message"]["tool_calls"][0]["function"]  # still a call, its arguments as far as they came
    assert cut["name"] == "weather" and '{"city": "Paris"}'.startswith(cut["arguments"]) and cut["arguments"]
    said = '{"name": "weather", "arguments": {"city": "Paris"}}'
    completions, _ = make_completions(smollm2_tokenizer, _workers(smollm2_tokenizer, said))
    required = answer(completions, {**ASK, "tool_choice": "required", "max_tokens": 11}, is_chat=True)["choices"][0]
    call = required["message"]["tool_calls"][0]["function"]
    assert required["finish_reason"] == "length" and call["name"] == "weather"
    assert '{"city": "Paris"}}'.startswith(call["arguments"])
    two = ('<tool_call>{"name": "weather", "arguments": {"city": "A"}}</tool_call>'
           '<tool_call>{"name": "time_in", "arguments": {}}</tool_call>')
    completions, _ = make_completions(hermes_tokenizer, _workers(hermes_tokenizer, two))
    both = answer(completions, {**ASK, "max_tokens": 60}, is_chat=True)["choices"][0]["message"]["tool_calls"]
    one = answer(completions, {**ASK, "max_tokens": 60, "parallel_tool_calls": False},
                 is_chat=True)["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in both] == ["weather", "time_in"] and len(one) == 1


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": {"type": "function", "function": "weather"}}, "tool_choice must be"),
    ({"tool_choice": {"type": "function", "function": {"name": ["weather"]}}}, "tool_choice must be"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "the same function twice"),
])
def test_malformed_tool_requests_are_400s(smollm2_tokenizer, fields, words):
    completions, _ = make_completions(smollm2_tokenizer, _workers(smollm2_tokenizer, "x"))
    with pytest.raises(APIError, match=words) as raised:
        answer(completions, {**ASK, **fields}, is_chat=True)
    assert raised.value.status_code == 400


def test_bad_calls_and_schemas_are_refused_and_tool_results_become_user_turns(smollm2_tokenizer):
    with pytest.raises(ValueError, match="a JSON object as text"):
        protocol.ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "weather", "arguments": "{not json"}}]})
    with pytest.raises(ValueError, match="parameters must be an object schema"):
        protocol.ToolSpec.model_validate({"type": "function", "function": {"name": "f",
                                                                            "parameters": {"type": "integer"}}})
    req = protocol.ChatCompletionRequest.model_validate({"model": "m", "tools": [WEATHER], "tool_choice": "required",
                                                         "messages": [{"role": "system", "content": "Be brief."},
                                                                      {"role": "tool", "content": "18 C"}]})
    messages, _ = template_messages(req, protocol.chat_messages(req), smollm2_tokenizer)
    assert [m["role"] for m in messages] == ["system", "user"]  # one system turn, the listing appended to it
    assert messages[0]["content"].startswith("Be brief.") and '"weather"' in messages[0]["content"]
    assert messages[1]["content"] == "The call returned: 18 C"
