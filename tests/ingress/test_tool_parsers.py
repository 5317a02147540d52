"""Tool calls read in each model family's own format, as vLLM's --tool-call-parser names them: unit cases for every
parser, and an "auto" answer read through the chat endpoint (scripted worker streams, no Ray) by a configured one."""

import copy
import json

import pytest
from openai.types.chat import ChatCompletion

from cluster.ingress.errors import APIError
from cluster.ingress.tool_parsers import TOOL_PARSERS, parser_for
from test_completions import ScriptedWorkers, answer, make_completions  # noqa: F401 (fixture)

PARIS = ("weather", {"city": "Paris"})
ROME = ("weather", {"city": "Rome", "days": 2})


@pytest.mark.parametrize("parser, text, calls, besides", [
    ("hermes", 'Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>',
     [PARIS], "Let me look.\n"),  # the text as the model wrote it, as vLLM's parsers give it
    ("hermes", "<tool_call>{not json}</tool_call> Sunny.", None, "<tool_call>{not json}</tool_call> Sunny."),
    ("llama3_json", '<|python_tag|>{"name": "weather", "parameters": {"city": "Paris"}}', [PARIS], None),
    ("llama3_json", '{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "weather", "parameters": '
                    '{"city": "Rome", "days": 2}}', [PARIS, ROME], None),
    ("llama3_json", '{"name": "weather", "parameters": {"note": "a; b"}}', [("weather", {"note": "a; b"})], None),
    ("llama3_json", "It is sunny in Paris.", None, "It is sunny in Paris."),
    ("mistral", '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}}, {"name": "weather", '
                '"arguments": {"city": "Rome", "days": 2}}]', [PARIS, ROME], None),
    ("mistral", 'Sure. [TOOL_CALLS]weather{"city": "Paris"}[TOOL_CALLS]weather{"city": "Rome", "days": 2}',
     [PARIS, ROME], "Sure. "),
    ("mistral", "No call here.", None, "No call here."),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</tool_call>\n<tool_call>\n<function=weather>\n<parameter=city>\n"
                    "Paris\n</parameter>\n</function>\n</tool_call>",  # a block without its </function> is no call
     [PARIS], "<tool_call>\n<function=f>\n</tool_call>\n"),
    ("qwen3_coder", "Checking.\n<tool_call>\n<function=weather>\n<parameter=city>\nRome\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>", [ROME], "Checking.\n"),
])
def test_each_format_gives_its_calls_and_the_text_besides(parser, text, calls, besides):
    read = TOOL_PARSERS[parser].calls(text)
    assert read == calls if calls is None else [(name, json.loads(arguments)) for name, arguments in read] == calls
    assert TOOL_PARSERS[parser].besides(text) == besides


def test_without_a_configured_parser_only_a_template_writing_hermes_tags_is_read():
    assert parser_for(None, "... <tool_call> ...").name == "hermes"
    assert parser_for(None, "... <tool_call><function=f> ...") is None  # Qwen3-Coder's: needs its parser named
    assert parser_for(None, "{{ tools }}") is None
    assert parser_for("mistral", "{{ tools }}").name == "mistral"


# A Llama-3-shaped template written for this test: tools in the first user turn, calls as bare JSON.
LLAMA_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if loop.first and tools %}Call a function as {\"name\": ..., \"parameters\": ...}: {{ tools | tojson }}\n"
    "{% endif %}{{ m['content'] or '' }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")
ASK = {"messages": [{"role": "user", "content": "Weather in Paris and Rome?"}], "max_tokens": 80,
       "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]}


def test_auto_reads_parallel_calls_with_the_configured_parser(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = LLAMA_TEMPLATE
    said = '{"name": "weather", "parameters": {"city": "Paris"}}; {"name": "weather", "parameters": {"city": "Rome"}}'
    workers = ScriptedWorkers(tokenizer(said, add_special_tokens=False)["input_ids"])
    with pytest.raises(APIError, match="no --tool-call-parser is set"):
        answer(make_completions(tokenizer, workers)[0], ASK, is_chat=True)
    completions = make_completions(tokenizer, workers)[0]
    completions.config.tool_call_parser = "llama3_json"
    choice = ChatCompletion.model_validate(answer(completions, ASK, is_chat=True)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [json.loads(call.function.arguments)["city"] for call in choice.message.tool_calls] == ["Paris", "Rome"]
    assert len({call.id for call in choice.message.tool_calls}) == 2
