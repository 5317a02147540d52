"""The messages and tools of a chat request (pydantic, strict, as `cluster.ingress.openai_protocol` reads bodies), and
what it hands the chat template besides them."""

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, field_validator, model_validator


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class FunctionSpec(BaseModel):
    """A function the model may call: its name, what it does and its parameters' JSON schema."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: StrictStr | None = None
    parameters: dict[StrictStr, Any] | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("parameters must be an object schema (a call's arguments are a JSON object)")
        return value


class ToolSpec(BaseModel):
    """One entry of `tools` (only functions exist)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class ChatMessage(BaseModel):
    """One message of a chat.

    Attributes:
        role: "system", "user", "assistant" or "tool" ("developer" is read as "system").
        content: the text; the list-of-parts form `[{"type": "text", "text": ...}]` is
            accepted and its text parts joined with newlines. None only in an assistant message with tool_calls.
        tool_calls: an assistant's earlier calls, in OpenAI's form.
        tool_call_id: a tool message's call.
        name: the speaker's name (OpenAI's), handed to the chat template as vLLM does.
        reasoning_content: an assistant's earlier thinking (vLLM's, also as `reasoning`), handed to the chat
            template, which renders it or leaves it out as the model was trained.
    """

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: StrictStr | None = None
    tool_calls: list[dict[StrictStr, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError("only assistant messages carry reasoning_content")
        for call in self.tool_calls or ():
            function = call.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(
                    function.get("arguments", "{}"), str) or not _is_json_object(function.get("arguments", "{}")):
                raise ValueError('each tool call must be {"function": {"name": ..., "arguments": "<a JSON object as '
                                 'text>"}}')
        return self

    @field_validator("role", mode="before")
    @classmethod
    def _developer_is_system(cls, value: Any) -> Any:
        # Newer OpenAI clients send "developer" where older ones sent "system".
        return "system" if value == "developer" else value

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError('content parts must be {"type": "text", "text": <string>}; only text is supported')
            texts.append(part["text"])
        return "\n".join(texts)


# apply_chat_template's own arguments, and the template variables a request sets through its own fields.
RESERVED_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                         "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                         "truncation", "max_length", "return_tensors", "return_dict",
                                         "return_assistant_tokens_mask", "tokenizer_kwargs", "reasoning_effort"})


def template_options(req) -> tuple[bool, bool, dict[str, Any]]:
    """(add_generation_prompt, continue_final_message, the template's extra variables: chat_template_kwargs and
    reasoning_effort) of a chat completion request, as vLLM passes them to the chat template."""
    extra = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        extra["reasoning_effort"] = req.reasoning_effort
    return not req.continue_final_message and req.add_generation_prompt is not False, bool(
        req.continue_final_message), extra
