"""Request parameters the router accepts only at their default: each is a 400 naming it when set to anything else,
never silently dropped (`cluster.ingress.openai_protocol` declares them and validates them with `reject_non_default`).

Field -> the values that mean "not used".
"""

from typing import Any

from pydantic import ValidationInfo

# On both endpoints: vLLM's extras that change the output and that we do not implement (clients moving from
# vLLM send them through `extra_body`): guided decoding and structured outputs, beam search, prompt logprobs.
SHARED_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "include_stop_str_in_output": (None, False),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "return_tokens_as_token_ids": (None, False),
}
# On /v1/completions: OpenAI's suffix, and structured output.
COMPLETION_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
}
# On /v1/chat/completions: tools and structured output, and chat-template controls.
CHAT_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "documents": (None,),
    "prediction": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "reasoning_effort": (None,),
}


def reject_non_default(value: Any, info: ValidationInfo, table: dict[str, tuple[Any, ...]]) -> Any:
    # `in` on a tuple compares with ==, and True == 1, so compare types too.
    if not any(value == allowed and type(value) is type(allowed) for allowed in table[info.field_name]):
        raise ValueError(f"'{info.field_name}' is not supported by this server; leave it unset")
    return value
