"""OpenAI's Responses API (`POST /v1/responses`), stateless: a request becomes a chat completion and its answer a
response, streamed as the Responses events or whole (pure: the chat endpoint's answer is passed in).

What is read: `input` (a text, or items: messages with text content, `function_call` and `function_call_output`
items, `reasoning` items whose text goes back to the template as the assistant's earlier thinking),
`instructions` (a system message), function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format`
(json_schema, json_object), `reasoning.effort`, `max_output_tokens`, `temperature`, `top_p`, `stream`. Nothing is
stored: `store: true`, `previous_response_id`, `conversation` and `background` are 400s saying so, as are tool kinds
other than functions; `include` (encrypted reasoning and such: nothing is kept to include) is named in the
x-s3-ignored-fields header; fields that name or tag a request (`metadata`, `user`, ...) have no effect.

Output items: the thinking (with a reasoning parser) as a `reasoning` item, the text as a `message`, each call as a
`function_call`; an answer cut by `max_output_tokens` is `incomplete`.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

MaxTokens = Annotated[StrictInt, Field(ge=1)]


class ResponsesRequest(BaseModel):
    """A `/v1/responses` body (see the module docstring for what each field does)."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: StrictStr
    input: StrictStr | list[dict[StrictStr, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[StrictFloat, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0.0, le=1.0)] | None = None
    stream: StrictBool | None = None
    tools: list[dict[StrictStr, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[StrictStr, Any] | None = None
    reasoning: dict[StrictStr, Any] | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool | None = None
    include: list[StrictStr] | None = None
    truncation: Literal["disabled"] | None = None
    top_logprobs: Literal[0] | None = None
    max_tool_calls: Any = None
    # no effect on the answer: they name, tag or route a request
    metadata: Any = None
    user: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    service_tier: Any = None
    stream_options: Any = None

    @model_validator(mode="after")
    def _stateless(self):
        refused = {"store": self.store is True, "previous_response_id": self.previous_response_id is not None,
                   "conversation": self.conversation is not None, "background": self.background is True,
                   "max_tool_calls": self.max_tool_calls is not None}
        for field, is_set in refused.items():
            if is_set:
                raise ValueError(f"'{field}' is not supported: this server keeps no responses (send the whole "
                                 "conversation as input, with store false)")
        return self


def chat_body(req: ResponsesRequest) -> dict:
    """The chat completion request that answers `req` (the chat endpoint then checks what it holds)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    thinking = None
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": item.get("role"), "content": _text_of(item.get("content"))}
            if thinking is not None and message["role"] == "assistant":
                message["reasoning_content"], thinking = thinking, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                 **({"reasoning_content": thinking} if thinking is not None else {})})
                thinking = None
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(part, dict) for part in parts):
                raise ValueError("a reasoning item's content and summary must be lists of {\"type\", \"text\"} parts")
            thinking = "".join(str(part.get("text", "")) for part in parts)
        else:
            raise ValueError(f"input items of type {kind!r} are not supported here (message, function_call, "
                             "function_call_output, reasoning)")
    body = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.tools:
        body["tools"] = [_chat_tool(tool) for tool in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.get("name")}}
                               if isinstance(choice, dict) else choice)
    text_format = (req.text or {}).get("format") or {"type": "text"}
    if not isinstance(text_format, dict):
        raise ValueError(f"text.format must be an object such as {{\"type\": \"json_schema\", ...}}, got "
                         f"{text_format!r}")
    if text_format.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}}
    elif text_format.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif text_format.get("type") != "text":
        raise ValueError(f"text.format must be text, json_schema or json_object, got {text_format.get('type')!r}")
    if (req.reasoning or {}).get("effort") is not None:
        body["reasoning_effort"] = req.reasoning["effort"]
    return body


def response_from_chat(req: ResponsesRequest, chat: dict) -> dict:
    """The whole response, from the chat endpoint's answer to `chat_body(req)`."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(message["reasoning_content"]))
    cut = choice["finish_reason"] == "length"
    if message.get("content"):
        output.append(_message_item(message["content"], "incomplete" if cut else "completed"))
    output += [_call_item(call) for call in message.get("tool_calls") or ()]
    return _response(req, response_id(), int(time.time()), "incomplete" if cut else "completed", output,
                     _usage_of(chat["usage"]))


async def response_events(req: ResponsesRequest, chat_chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The Responses stream, from the chat endpoint's stream of `chat_body(req)` (server-sent chat chunks)."""
    stream = _EventStream(req)
    yield stream.event("response.created", response=stream.snapshot("in_progress"))
    yield stream.event("response.in_progress", response=stream.snapshot("in_progress"))
    try:
        async for raw in chat_chunks:
            for line in raw.decode().splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    yield stream.event("error", code="server_error", message=chunk["error"].get("message", ""),
                                       param=None)
                    return
                for event in stream.chunk(chunk):
                    yield event
        for event in stream.finish():
            yield event
    finally:
        await chat_chunks.aclose()


class _EventStream:
    """The state of one Responses stream: the items open so far and the events' sequence numbers."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.id = response_id()
        self.created_s = int(time.time())
        self.sequence = 0
        self.output: list[dict] = []
        self.text_index: int | None = None  # the message item's place in `output`, once text came
        self.reasoning_index: int | None = None
        self.call_items: dict[int, int] = {}  # a chat call's index -> its item's place in `output`
        self.open_call: int | None = None  # the call item taking arguments
        self.finish_reason: str | None = None
        self.usage = _usage(0, 0)

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()

    def snapshot(self, status: str) -> dict:
        return _response(self.req, self.id, self.created_s, status, self.output, self.usage)

    def chunk(self, chunk: dict) -> list[bytes]:
        if chunk.get("usage"):
            self.usage = _usage_of(chunk["usage"])
        events = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            calls = delta.get("tool_calls") or ()
            if delta.get("reasoning_content"):
                events += self._reasoning(delta["reasoning_content"])
            for call in calls:  # the end of a call open before comes before text after it
                if "id" not in call:
                    events += self._call(call)
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in calls:
                if "id" in call:
                    events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def _reasoning(self, delta: str) -> list[bytes]:
        events = []
        if self.reasoning_index is None:
            self.reasoning_index = len(self.output)
            self.output.append({**_reasoning_item(""), "status": "in_progress"})
            events.append(self.event("response.output_item.added", output_index=self.reasoning_index,
                                     item=self.output[self.reasoning_index]))
        item = self.output[self.reasoning_index]
        item["content"][0]["text"] += delta
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                 output_index=self.reasoning_index, content_index=0, delta=delta))
        return events

    def _text(self, delta: str) -> list[bytes]:
        events = self._close_reasoning() + self._close_call()
        if self.text_index is None or self.output[self.text_index]["status"] != "in_progress":  # (text after a
            # call opens a message item of its own)
            self.text_index = len(self.output)
            item = {**_message_item("", "in_progress"), "content": []}
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=self.text_index, item=item))
            item["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.text_index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        item = self.output[self.text_index]
        item["content"][0]["text"] += delta
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=self.text_index,
                                 content_index=0, delta=delta, logprobs=[]))
        return events

    def _call(self, delta: dict) -> list[bytes]:
        """A chat stream's call delta: its first (with the call's id) opens an item, each carries an arguments
        fragment."""
        events = []
        if "id" in delta:  # each item closes before the next opens
            events += self._close_reasoning() + self._close_text() + self._close_call()
            self.open_call = self.call_items[delta["index"]] = len(self.output)
            self.output.append({**_call_item(delta), "arguments": "", "status": "in_progress"})
            events.append(self.event("response.output_item.added", output_index=self.open_call,
                                     item=dict(self.output[self.open_call])))
        index = self.call_items[delta["index"]]
        fragment = delta["function"].get("arguments") or ""
        if fragment:
            item = self.output[index]
            item["arguments"] += fragment
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=index, delta=fragment))
        return events

    def _close_call(self) -> list[bytes]:
        if self.open_call is None:
            return []
        index, self.open_call = self.open_call, None
        item = self.output[index]
        item["status"] = "completed"
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _close_reasoning(self) -> list[bytes]:
        if self.reasoning_index is None or self.output[self.reasoning_index].get("status") != "in_progress":
            return []
        item = self.output[self.reasoning_index]
        del item["status"]
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=self.reasoning_index,
                           content_index=0, text=item["content"][0]["text"]),
                self.event("response.output_item.done", output_index=self.reasoning_index, item=item)]

    def _close_text(self) -> list[bytes]:
        if self.text_index is None or self.output[self.text_index]["status"] != "in_progress":
            return []
        item = self.output[self.text_index]
        part = item["content"][0]
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        return [self.event("response.output_text.done", item_id=item["id"], output_index=self.text_index,
                           content_index=0, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", item_id=item["id"], output_index=self.text_index,
                           content_index=0, part=part),
                self.event("response.output_item.done", output_index=self.text_index, item=item)]

    def finish(self) -> list[bytes]:
        events = self._close_reasoning() + self._close_text() + self._close_call()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events.append(self.event(f"response.{status}", response=self.snapshot(status)))
        return events


def response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _text_of(content: Any) -> Any:
    """A message's content as text: input_text / output_text parts joined (anything else is left for the chat
    endpoint to refuse by name)."""
    if not isinstance(content, list):
        return content
    if all(isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") for part in content):
        return "\n".join(str(part.get("text", "")) for part in content)
    raise ValueError("message content parts must be input_text or output_text; only text is supported")


def _chat_tool(tool: dict) -> dict:
    if tool.get("type") != "function":
        raise ValueError(f"tools of type {tool.get('type')!r} are not supported here; only function tools are")
    return {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters", "strict")
                                             if tool.get(key) is not None}}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _usage_of(chat_usage: dict) -> dict:
    """The Responses API's usage from the chat endpoint's."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return _usage(chat_usage["prompt_tokens"], chat_usage["completion_tokens"], cached)


def _usage(num_input: int, num_output: int, num_cached: int = 0) -> dict:
    return {"input_tokens": num_input, "input_tokens_details": {"cached_tokens": num_cached, "cache_write_tokens": 0},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": num_input + num_output}


def _response(req: ResponsesRequest, identifier: str, created_s: int, status: str, output: list[dict],
              usage: dict) -> dict:
    return {"id": identifier, "object": "response", "created_at": created_s, "model": req.model, "status": status,
            "output": [dict(item) for item in output], "usage": usage, "instructions": req.instructions,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "store": False, "metadata": req.metadata if isinstance(req.metadata, dict) else {}}
