"""Tool calls streamed as OpenAI streams them: the text besides the calls as content, each call's id and name first,
then its arguments in fragments, read in each parser's format as the text comes in pieces of any size, joining to what
the whole answer reads; and the same through the chat endpoint (scripted worker streams, no Ray) in the openai
package's own chunk types."""

import copy
import json
import random

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cluster.ingress.json_members import scan_object
from cluster.ingress.tool_call_stream import ToolCallStream
from cluster.ingress.tool_calls import calls_of, text_besides_calls
from test_completions import ScriptedWorkers, answer, make_completions, stream  # noqa: F401 (fixture)
from test_tool_parsers import ASK, LLAMA_TEMPLATE

PARIS = '{"city": "Paris", "note": "a } and \\" inside", "days": [1, {"x": null}]}'
ROME = '{"city": "Rome é", "days": 2}'
ARGUMENTS_FIRST = f'<tool_call>{{"arguments": {ROME}, "name": "weather"}}</tool_call> Done.'
ANSWERS = [  # (tool_choice, parser, text, the calls' names)
    ("auto", "hermes", f'Let me look.\n<tool_call>{{"name": "weather", "arguments": {PARIS}}}</tool_call>\n'
                       f'<tool_call>{{"name": "weather", "arguments": {ROME}}}</tool_call>', ["weather", "weather"]),
    ("auto", "hermes", ARGUMENTS_FIRST, ["weather"]),
    ("auto", "hermes", "<tool_call>{not json}</tool_call> Sunny.", []),
    ("auto", "hermes", "It is sunny in Paris. <tool", []),
    ("auto", "llama3_json", f'<|python_tag|>{{"name": "weather", "parameters": {PARIS}}}', ["weather"]),
    ("auto", "llama3_json", f'{{"name": "weather", "parameters": {PARIS}}}; {{"name": "time_in", "parameters": {{}}}}',
     ["weather", "time_in"]),
    ("auto", "llama3_json", "It is sunny in Paris.", []),
    ("auto", "mistral", f'[TOOL_CALLS] [{{"name": "weather", "arguments": {PARIS}}}, {{"name": "weather", '
                        f'"arguments": {ROME}}}]', ["weather", "weather"]),
    ("auto", "mistral", f"Sure. [TOOL_CALLS]weather{PARIS}[TOOL_CALLS]weather{ROME}", ["weather", "weather"]),
    ("auto", "mistral", "No call here.", []),
    ("auto", "qwen3_coder", "Checking.\n<tool_call>\n<function=weather>\n<parameter=city>\nRome\n</parameter>\n"
                            "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>", ["weather"]),
    ("weather", None, ROME, ["weather"]),
    ("required", None, f'{{"name": "weather", "arguments": {PARIS}}}', ["weather"]),
    ("required", None, '{"name": "weather", "arguments": {"city": "Par', ["weather"]),  # cut by the limit
    ("required", None, f'[{{"name": "weather", "arguments": {PARIS}}}, {{"name": "weather", "arguments": {ROME}}}]',
     ["weather", "weather"]),  # parallel calls
    ("required", None, f'[{{"name": "weather", "arguments": {PARIS}}}, {{"name": "weather", "arguments": {{"ci',
     ["weather", "weather"]),
    ("required", None, f'[{{"name": "weather", "arguments": {PARIS}}}, {{"name": "weather"', ["weather", "weather"]),
    ("auto", "qwen3_coder", "<tool_call>\n<function=write>\n<parameter=content>\nend of </function> tag\n</parameter>\n"
                            "<parameter=path>\na.xml\n</parameter>\n</function>\n</tool_call>", ["write"]),
]


def _streamed(choice: str, parser: str | None, text: str, seed: int, max_calls: int | None = None):
    """The content and calls a stream sends for `text` in random pieces, each call's arguments fragments, and how
    much of the text had come when each call's first delta was sent."""
    rng, calls_stream = random.Random(seed), ToolCallStream(choice, parser, max_calls)
    content, calls, opened_at, at = "", {}, {}, 0

    def take(content_delta: str, deltas: list[dict]) -> None:
        nonlocal content
        content += content_delta
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] not in calls and delta["type"] == "function" and delta["id"].startswith("call_")
                calls[delta["index"]] = (delta["function"]["name"], [])
                opened_at[delta["index"]] = at
            calls[delta["index"]][1].append(delta["function"]["arguments"])

    while at < len(text):
        piece = text[at:at + rng.randint(1, 5)]
        at += len(piece)
        take(*calls_stream.push(piece))
    whole_calls = calls_of(choice, text, parser)
    if max_calls is not None and whole_calls:
        whole_calls = whole_calls[:max_calls]
    whole_content = (text_besides_calls(choice, text, parser) if whole_calls else text) if choice == "auto" else None
    take(*calls_stream.finish(whole_calls, whole_content))
    return content, [calls[i] for i in sorted(calls)], opened_at, whole_calls, whole_content


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("choice, parser, text, names", ANSWERS)
def test_pieces_of_any_size_join_to_what_the_whole_answer_reads(choice, parser, text, names, seed):
    content, calls, opened_at, whole_calls, whole_content = _streamed(choice, parser, text, seed)
    assert content == (whole_content or "")
    assert [name for name, _ in calls] == names == [call["function"]["name"] for call in whole_calls or ()]
    assert ["".join(fragments) for _, fragments in calls] == [c["function"]["arguments"] for c in whole_calls or ()]
    for index, (_, fragments) in enumerate(calls):
        # JSON arguments stream as they are written; arguments written before the name come whole with it
        if len("".join(fragments)) > 10 and (choice, parser) != ("auto", "qwen3_coder") and text != ARGUMENTS_FIRST:
            assert len([f for f in fragments if f]) > 2, "arguments came in fragments, not whole at the end"
            assert opened_at[index] < len(text)  # the call opened before the answer was complete


def test_the_arguments_are_the_json_the_model_wrote():
    calls = calls_of("auto", f'<tool_call>{{"name": "weather", "arguments": {ROME}}}</tool_call>', "hermes")
    assert calls[0]["function"]["arguments"] == ROME  # its spacing and its "é", not re-encoded
    assert json.loads(calls_of("auto", "<tool_call>\n<function=f>\n<parameter=a>\n{\"b\": 1}\n</parameter>\n"
                                       "<parameter=c>\ntext\n</parameter>\n</function>\n</tool_call>",
                               "qwen3_coder")[0]["function"]["arguments"]) == {"a": {"b": 1}, "c": "text"}
    scanned = scan_object('{"a": "}", "b": [1, "]"], "c": 3}')
    assert scanned.end is not None and not scanned.broken and list(scanned.members) == ["a", "b", "c"]
    assert scan_object("[1, 2]").broken and scan_object('{"a" 1}').broken


def test_text_streams_as_it_comes_and_one_call_is_kept_when_parallel_calls_are_off():
    calls_stream = ToolCallStream("auto", "llama3_json")
    assert calls_stream.push("It is") == ("It is", [])  # a Llama answer that opens as text is text
    hermes = ToolCallStream("auto", "hermes")
    assert hermes.push("\n") == ("", [])  # only whitespace so far: held, as an answer of calls alone sends none
    assert hermes.push("Hello <tool_") == ("\nHello ", [])  # perhaps the start of a call: held back
    assert hermes.push("x> there") == ("<tool_x> there", [])
    text = ANSWERS[0][2]
    content, calls, *_ = _streamed("auto", "hermes", text, seed=0, max_calls=1)
    assert content == "Let me look.\n\n" and len(calls) == 1


MISTRAL_TEMPLATE = LLAMA_TEMPLATE.replace("Call a function as", "[AVAILABLE_TOOLS]")
QWEN_TEMPLATE = LLAMA_TEMPLATE.replace("Call a function as", "<tool_call><function=...>")


@pytest.mark.parametrize("parser, template, said", [
    ("hermes", LLAMA_TEMPLATE, '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>\n'
                               '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>'),
    ("llama3_json", LLAMA_TEMPLATE, '{"name": "weather", "parameters": {"city": "Paris"}}; '
                                    '{"name": "weather", "parameters": {"city": "Rome"}}'),
    ("mistral", MISTRAL_TEMPLATE, '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris"}}, '
                                  '{"name": "weather", "arguments": {"city": "Rome"}}]'),
    ("qwen3_coder", QWEN_TEMPLATE, "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n"
                                   "</function>\n</tool_call>\n<tool_call>\n<function=weather>\n<parameter=city>\n"
                                   "Rome\n</parameter>\n</function>\n</tool_call>"),
])
def test_auto_streams_parallel_calls_in_each_parsers_format(smollm2_tokenizer, parser, template, said):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = template
    workers = ScriptedWorkers(tokenizer(said, add_special_tokens=False)["input_ids"])
    completions = make_completions(tokenizer, workers)[0]
    completions.config.tool_call_parser = parser
    whole = ChatCompletion.model_validate(answer(completions, ASK, is_chat=True)).choices[0].message.tool_calls
    chunks = [ChatCompletionChunk.model_validate(c) for c in stream(completions, ASK, is_chat=True)]
    deltas = [(n, d) for n, c in enumerate(chunks) for d in c.choices[0].delta.tool_calls or ()]
    opened = {d.index: (n, d.function.name) for n, d in deltas if d.id is not None}
    assert [name for _, name in opened.values()] == ["weather", "weather"] and sorted(opened) == [0, 1]
    joined = ["".join(d.function.arguments or "" for _, d in deltas if d.index == i) for i in (0, 1)]
    assert joined == [call.function.arguments for call in whole]
    assert [json.loads(arguments)["city"] for arguments in joined] == ["Paris", "Rome"]
    assert opened[0][0] < opened[1][0] < len(chunks) - 1  # the first call was out before the second began
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks)


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>'),  # unquoted name
    ("hermes", '<tool_call>{"name": "f\\q", "arguments": {}}</tool_call>'),  # a bad escape
    ("hermes", '<tool_call>{"na\\qme": "f", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "f\tg", "parameters": {}}'),  # a raw tab in a string
    ("mistral", '[TOOL_CALLS][{"name": [}, "arguments": {}}]'),
    ("hermes", 'abc <tool_call>x {"name": "f", "arguments": {"a": [1}}}</tool_call>'),  # text before it, [ closed by }
])
def test_malformed_calls_stream_as_the_text_the_whole_answer_reads(parser, text):
    content, calls, _, whole_calls, whole_content = _streamed("auto", parser, text, seed=3)
    assert whole_calls is None and calls == [] and content == whole_content == text


@pytest.mark.parametrize("broken", [
    '{"name": "f", "arguments": {"a": 1}}}',  # one brace too many
    '{"name": "f", arguments: {}}',  # an unquoted key
])
def test_a_call_broken_after_it_was_sent_keeps_its_index_and_the_next_call_is_not_lost(broken):
    text = f'<tool_call>{broken}</tool_call>\n<tool_call>{{"name": "g", "arguments": {{"b": 2}}}}</tool_call>'
    whole = calls_of("auto", text, "hermes")
    assert [call["function"]["name"] for call in whole] == ["g"]  # the whole answer has g alone
    calls_stream, cut = ToolCallStream("auto", "hermes"), text.index('"f", ') + len('"f", ')
    deltas = [*calls_stream.push(text[:cut])[1], *calls_stream.push(text[cut:])[1]]  # f was sent, then broke
    deltas += calls_stream.finish(whole, text_besides_calls("auto", text, "hermes"))[1]
    joined = {}
    for delta in deltas:
        name, arguments = joined.get(delta["index"], (delta["function"].get("name"), ""))
        joined[delta["index"]] = name, arguments + delta["function"]["arguments"]
    assert joined == {0: ("f", ""), 1: ("g", '{"b": 2}')}  # f stays as sent; the whole answer's g takes place 1


def test_the_responses_stream_closes_a_call_only_after_its_last_fragment():
    from cluster.ingress.openai_protocol import chat_chunk
    from cluster.ingress.responses_api import ResponsesRequest, _EventStream

    events = _EventStream(ResponsesRequest.model_validate({"model": "m", "input": "x"}))
    calls_stream, sent = ToolCallStream("auto", "hermes"), []
    for piece in ['<tool_call>{"name": "f", "arguments": {"a": ', '1}}</tool_call> Done.']:  # one piece: both
        content, deltas = calls_stream.push(piece)
        sent += events.chunk(chat_chunk("r", "m", content or None, None, 0, tool_calls=deltas or None))
    kinds = [json.loads(event.decode().split("data: ", 1)[1]) for event in sent]
    done = next(event for event in kinds if event["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"a": 1}'
    order = [event["type"] for event in kinds]
    assert order.index("response.output_item.done") > max(i for i, kind in enumerate(order)
                                                          if kind == "response.function_call_arguments.delta")
    assert order[-1] == "response.output_text.delta"  # the text after the call, in an item of its own
