"""vLLM's chat-template controls on the chat endpoint (scripted worker streams, no Ray): chat_template_kwargs and
reasoning_effort reach a template that reads them and are a 400 for one that does not; continue_final_message
continues the assistant's last message; add_generation_prompt false opens no turn."""

import asyncio
import copy

import pytest
from pydantic import ValidationError

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.errors import APIError
from test_completions import ScriptedWorkers, answer, make_completions  # noqa: F401 (fixture)

# A template written for these tests: a role marker per message, and a thinking switch and an effort hint, as
# Qwen3's and gpt-oss's templates read them.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% if reasoning_effort %}[effort {{ reasoning_effort }}]{% endif %}{% endif %}")
ASK = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 4}


@pytest.fixture
def thinking_tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


def _prompt(tokenizer, body: dict) -> str:
    workers = ScriptedWorkers(tokenizer("4", add_special_tokens=False)["input_ids"])
    answer(make_completions(tokenizer, workers)[0], body, is_chat=True)
    return tokenizer.decode(workers.jobs[0].prompt_token_ids)


def test_template_variables_reach_a_template_that_reads_them(thinking_tokenizer):
    assert _prompt(thinking_tokenizer, ASK).endswith("<|assistant|>")
    off = _prompt(thinking_tokenizer, {**ASK, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|assistant|><think></think>")
    assert _prompt(thinking_tokenizer, {**ASK, "reasoning_effort": "low"}).endswith("[effort low]")


def test_a_variable_the_template_never_reads_is_named_in_the_ignored_fields_header(smollm2_tokenizer):
    workers = ScriptedWorkers(smollm2_tokenizer("4", add_special_tokens=False)["input_ids"])
    completions = make_completions(smollm2_tokenizer, workers)[0]
    body = {**ASK, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "high", "model": "m"}

    async def run():
        return await completions.answer(protocol.ChatCompletionRequest.model_validate(body), True, None, ("x",))

    response = asyncio.run(run())
    assert response.headers["x-s3-ignored-fields"] == "x, chat_template_kwargs.enable_thinking, reasoning_effort"


def test_a_template_that_cannot_render_the_messages_is_a_400(thinking_tokenizer):
    tokenizer = copy.deepcopy(thinking_tokenizer)
    tokenizer.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(APIError) as raised:
        _prompt(tokenizer, ASK)
    assert raised.value.status_code == 400 and "cannot render" in raised.value.message


def test_continue_final_message_continues_the_assistants_words(thinking_tokenizer):
    body = {**ASK, "messages": [*ASK["messages"], {"role": "assistant", "content": "The answer is"}],
            "continue_final_message": True, "add_generation_prompt": False}
    assert _prompt(thinking_tokenizer, body).endswith("<|assistant|>The answer is")
    no_turn = {**ASK, "add_generation_prompt": False}
    assert _prompt(thinking_tokenizer, no_turn).endswith("What is 2+2?<|end|>")


@pytest.mark.parametrize("extra, message", [
    ({"continue_final_message": True}, "needs the last message to be the assistant's"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
    ({"chat_template_kwargs": {"tools": []}}, "may not set 'tools'"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
])
def test_contradictory_template_options_are_refused(extra, message):
    with pytest.raises(ValidationError, match=message):
        protocol.ChatCompletionRequest.model_validate({"model": "m", **ASK, **extra})


def test_a_messages_name_and_earlier_reasoning_reach_the_template(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}|>"
                               "{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}{{ m.content }}"
                               "{% endfor %}<|assistant|>")
    body = {**ASK, "messages": [{"role": "user", "content": "2+2?", "name": "ann"},
                                {"role": "assistant", "content": "4", "reasoning_content": "two twos"},
                                {"role": "user", "content": "And 3+3?"}]}
    assert _prompt(tokenizer, body) == "<|user:ann|>2+2?<|assistant|>(two twos)4<|user|>And 3+3?<|assistant|>"
    with pytest.raises(ValidationError, match="only assistant messages carry reasoning_content"):
        protocol.ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]})
