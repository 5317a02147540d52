"""A reasoning model's answer through the chat endpoint (scripted worker streams, no Ray): its thinking in
`reasoning_content` and `reasoning`, the rest in `content`, streamed and not, in the openai package's own types."""

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from test_completions import ScriptedWorkers, answer, make_completions, stream  # noqa: F401 (fixture)

ASK = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 60}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def _completions(tokenizer, text: str, parser: str | None = "qwen3"):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return make_completions(tokenizer, ScriptedWorkers(ids), reasoning_parser=parser)[0]


def _joined(chunks: list[dict], field: str) -> str:
    return "".join(chunk["choices"][0]["delta"].get(field) or "" for chunk in chunks if chunk.get("choices"))


def test_thinking_is_split_from_the_answer_whole_and_streamed(smollm2_tokenizer):
    text = "<think>\nTwo and two make four.\n</think>\n\nIt is 4."
    body = answer(_completions(smollm2_tokenizer, text), ASK, is_chat=True)
    message = ChatCompletion.model_validate(body).choices[0].message
    assert body["choices"][0]["message"]["reasoning_content"] == "\nTwo and two make four.\n"
    assert body["choices"][0]["message"]["reasoning"] == "\nTwo and two make four.\n"
    assert message.content == "\n\nIt is 4."
    chunks = stream(_completions(smollm2_tokenizer, text), ASK, is_chat=True)
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert _joined(chunks, "reasoning_content") == _joined(chunks, "reasoning") == "\nTwo and two make four.\n"
    assert _joined(chunks, "content") == "\n\nIt is 4."
    assert not any("think>" in (chunk["choices"][0]["delta"].get("content") or "") for chunk in chunks
                   if chunk.get("choices"))


def test_without_a_parser_or_a_think_block_the_text_is_the_answer(smollm2_tokenizer):
    text = "<think>hm</think>4"
    plain = answer(_completions(smollm2_tokenizer, text, parser=None), ASK, is_chat=True)["choices"][0]["message"]
    assert plain["content"] == text and "reasoning_content" not in plain
    direct = answer(_completions(smollm2_tokenizer, "It is 4."), ASK, is_chat=True)["choices"][0]["message"]
    assert direct["content"] == "It is 4." and "reasoning_content" not in direct


def test_an_answer_cut_while_thinking_is_all_reasoning_with_finish_reason_length(smollm2_tokenizer):
    body = answer(_completions(smollm2_tokenizer, "<think>Let me count the letters one by one carefully", "qwen3"),
                  {**ASK, "max_tokens": 6}, is_chat=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"].startswith("Let me")


def test_deepseek_r1_answers_start_inside_the_block(smollm2_tokenizer):
    chunks = stream(_completions(smollm2_tokenizer, "2+2 is 4.</think>Four.", "deepseek_r1"), ASK, is_chat=True)
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == ("2+2 is 4.", "Four.")


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_an_answer_under_a_grammar_has_no_think_block_and_is_all_content(smollm2_tokenizer, parser):
    named = {"type": "function", "function": {"name": "weather"}}
    body = answer(_completions(smollm2_tokenizer, '{"city": "Paris"}', parser),
                  {**ASK, "tools": [WEATHER], "tool_choice": named}, is_chat=True)
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Paris"}'
    json_body = answer(_completions(smollm2_tokenizer, '{"a": 1}', parser),
                       {**ASK, "response_format": {"type": "json_object"}}, is_chat=True)
    assert json_body["choices"][0]["message"]["content"] == '{"a": 1}'
