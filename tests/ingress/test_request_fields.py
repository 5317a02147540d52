"""Nothing a client sends is silently ignored: every field of OpenAI's request schemas (read from the openai
package's own types) and of vLLM's extra parameters is declared by our request models, and is either honoured,
accepted without effect on the answer (`NO_EFFECT`, named), or refused (400 naming it) unless left at its default."""

import re
from pathlib import Path

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest
from pydantic import ValidationError

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.unsupported_params import (CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, NO_EFFECT,
                                                 SHARED_UNSUPPORTED)

# vLLM's extra parameters of both endpoints (its protocol's sampling and structured-output fields), as clients
# moving from vLLM send them through `extra_body`.
VLLM_SHARED = ("top_k", "min_p", "repetition_penalty", "length_penalty", "use_beam_search", "stop_token_ids",
               "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
               "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
               "bad_words", "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
               "priority", "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
               "kv_transfer_params", "vllm_xargs", "request_id", "mm_processor_kwargs")
VLLM_CHAT = ("echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template",
             "chat_template_kwargs")

# What the endpoints serve, unless an endpoint's table refuses it there (chat's echo, vLLM's, differs from
# completions' and is refused); the rest of the declared fields are refused unless default, or have no effect.
HONOURED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
            "stream", "stream_options", "stop", "seed", "logit_bias", "presence_penalty", "frequency_penalty",
            "logprobs", "top_logprobs", "echo", "best_of", "top_k", "min_p", "repetition_penalty", "min_tokens",
            "stop_token_ids", "ignore_eos", "priority", "response_format", "guided_json", "guided_regex",
            "guided_choice", "guided_grammar", "structured_outputs", "guided_decoding_backend",
            "forced_output_tokens", "tools", "tool_choice", "parallel_tool_calls", "request_id", "add_special_tokens",
            "include_stop_str_in_output", "return_token_ids", "skip_special_tokens", "prompt_logprobs",
            "continue_final_message", "add_generation_prompt", "chat_template_kwargs", "reasoning_effort"}

ENDPOINTS = [
    (protocol.CompletionRequest, {**SHARED_UNSUPPORTED, **COMPLETION_UNSUPPORTED},
     set(completion_params.CompletionCreateParamsBase.__annotations__) | set(VLLM_SHARED),
     {"model": "m", "prompt": "hi"}),
    (protocol.ChatCompletionRequest, {**SHARED_UNSUPPORTED, **CHAT_UNSUPPORTED},
     set(chat_params.CompletionCreateParamsBase.__annotations__) | set(VLLM_SHARED) | set(VLLM_CHAT),
     {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("model_cls, unsupported, fields, base", ENDPOINTS, ids=["completions", "chat"])
def test_every_field_clients_send_is_declared_and_classified(model_cls, unsupported, fields, base):
    declared = set(model_cls.model_fields)
    assert not fields - declared, f"sent by clients but unknown here (silently dropped): {sorted(fields - declared)}"
    for field in sorted(fields):
        classes = [field in HONOURED and field not in unsupported, field in unsupported, field in NO_EFFECT]
        assert sum(classes) == 1, (field, classes)


@pytest.mark.parametrize("model_cls, unsupported, fields, base", ENDPOINTS, ids=["completions", "chat"])
def test_a_field_we_do_not_serve_is_refused_unless_at_its_default(model_cls, unsupported, fields, base):
    for field, defaults in unsupported.items():
        for default in defaults:
            model_cls.model_validate({**base, field: default})
        with pytest.raises(ValidationError, match=f"'{field}' is not supported"):
            model_cls.model_validate({**base, field: "something else"})


@pytest.mark.parametrize("model_cls, unsupported, fields, base", ENDPOINTS, ids=["completions", "chat"])
def test_fields_without_effect_are_accepted_at_any_value(model_cls, unsupported, fields, base):
    for field in NO_EFFECT:
        assert field in model_cls.model_fields
        model_cls.model_validate({**base, field: "tag-7"})


DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.md"
DOC_CLASSES = {"served": "served", "accepted without effect": "no_effect", "refused unless left at its default": "refused"}


def documented_fields() -> dict[str, dict[str, set[str]]]:
    """docs/api.md's "Every accepted field": endpoint -> class -> the fields it lists."""
    section = DOCS.read_text().split("## Every accepted field", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, dict[str, set[str]]] = {}
    endpoint = None
    for line in section.splitlines():
        if line.startswith("`POST "):
            endpoint = line.strip("`:").removeprefix("POST ")
        elif line.startswith("- ") and ":" in line and endpoint is not None:
            label, names = line[2:].split(":", 1)
            listed.setdefault(endpoint, {})[DOC_CLASSES[label]] = set(re.findall(r"`([^`]+)`", names))
    return listed


@pytest.mark.parametrize("path, endpoint", [("/v1/completions", ENDPOINTS[0]),
                                            ("/v1/chat/completions", ENDPOINTS[1])], ids=["completions", "chat"])
def test_the_docs_list_every_declared_field_as_it_is_treated(path, endpoint):
    model_cls, unsupported, _, _ = endpoint  # each endpoint's section, class by class
    declared = set(model_cls.model_fields)
    want = {"served": {f for f in declared if f in HONOURED and f not in unsupported},
            "no_effect": declared & set(NO_EFFECT), "refused": declared & set(unsupported)}
    assert documented_fields()[path] == want
