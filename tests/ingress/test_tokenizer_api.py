"""vLLM's /tokenize and /detokenize bodies and answers, with SmolLM2's own tokenizer."""

import pytest
from pydantic import ValidationError

from cluster.ingress.errors import APIError
from cluster.ingress.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize_answer, tokenize_answer
from workers.engine.models import DEFAULT_MODEL, chat_token_ids, load_tokenizer, resolve_model_dir


@pytest.fixture(scope="module")
def tokenizer(model_cache_dir):
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL, model_cache_dir))


def test_a_prompt_round_trips(tokenizer):
    answer = tokenize_answer(TokenizeRequest(model="m", prompt="The capital of France is"), tokenizer, 8192)
    assert answer["count"] == len(answer["tokens"]) > 3 and answer["max_model_len"] == 8192
    assert detokenize_answer(DetokenizeRequest(model="m", tokens=answer["tokens"]), tokenizer) == {
        "prompt": "The capital of France is"}


def test_messages_are_tokenized_as_chat_completions_tokenizes_them(tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    answer = tokenize_answer(TokenizeRequest(model="m", messages=messages), tokenizer, 100)
    assert answer["tokens"] == chat_token_ids(tokenizer, messages)


@pytest.mark.parametrize("body, match", [
    ({"model": "m"}, "send either prompt or messages"),
    ({"model": "m", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "send either prompt or messages"),
    ({"model": "m", "prompt": "a", "typo": 1}, "typo"),
    ({"model": "m", "messages": [{"role": "assistant", "content": "b"}], "continue_final_message": True},
     "cannot both be true"),
])
def test_bad_tokenize_bodies_are_refused(body, match):
    with pytest.raises(ValidationError, match=match):
        TokenizeRequest(**body)


def test_ids_past_the_vocabulary_are_a_400(tokenizer):
    with pytest.raises(ValidationError):
        DetokenizeRequest(model="m", tokens=[-1])
    with pytest.raises(APIError) as error:
        detokenize_answer(DetokenizeRequest(model="m", tokens=[len(tokenizer)]), tokenizer)
    assert error.value.status_code == 400 and error.value.param == "tokens"


def test_chat_messages_tokenize_with_what_the_chat_endpoint_hands_the_template(smollm2_tokenizer):
    import copy

    from cluster.ingress.tokenizer_api import TokenizeRequest, tokenize_answer

    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}|>"
                               "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
                               "{% if flag %}!{% endif %}")
    messages = [{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "content": "Hel"}]

    def text(**fields) -> str:
        req = TokenizeRequest.model_validate({"model": "m", "messages": messages, **fields})
        return tokenizer.decode(tokenize_answer(req, tokenizer, 2048)["tokens"])

    assert text() == "<|user:ann|>hi<|assistant|>Hel<|assistant|>"
    assert text(add_generation_prompt=False, continue_final_message=True) == "<|user:ann|>hi<|assistant|>Hel"
    assert text(chat_template_kwargs={"flag": True}).endswith("<|assistant|>!")
