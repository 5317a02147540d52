"""Request parameters the router accepts only at their default: each is a 400 naming it when set to anything else,
never silently dropped (`cluster.ingress.openai_protocol` declares them and validates them with `reject_non_default`).

Field -> the values that mean "not used".
"""

from typing import Any

from pydantic import ValidationInfo

# On both endpoints: vLLM's extras that change the output and that we do not implement (clients moving from
# vLLM send them through `extra_body`): a guided-decoding whitespace pattern, beam search, prompt logprobs.
SHARED_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "guided_whitespace_pattern": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
    "cache_salt": (None,),
    "logits_processors": (None, []),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "mm_processor_kwargs": (None,),
    "service_tier": (None, "auto", "default"),
}
# Accepted at any value, with no effect on the answer: they name, tag or route a request (OpenAI's caching key:
# prefix caching here is automatic), and nothing here stores or bills by them.
NO_EFFECT = ("user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
             "prompt_cache_options")
# On /v1/completions: OpenAI's suffix.
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
}
# On /v1/chat/completions: OpenAI's deprecated functions, and a per-request chat template.
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "chat_template": (None,),
    "add_special_tokens": (None, False),  # the chat template places the special tokens
    "documents": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "verbosity": (None,),
    "web_search_options": (None,),
    "moderation": (None,),
    "echo": (None, False),
}


def reject_non_default(value: Any, info: ValidationInfo, table: dict[str, tuple[Any, ...]]) -> Any:
    if info.field_name not in table:  # refused on the other endpoint only (chat's echo): served here
        return value
    # `in` on a tuple compares with ==, and True == 1, so compare types too.
    if not any(value == allowed and type(value) is type(allowed) for allowed in table[info.field_name]):
        raise ValueError(f"'{info.field_name}' is not supported by this server; leave it unset")
    return value
