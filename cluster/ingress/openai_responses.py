"""OpenAI-compatible response payloads of the router, as plain dicts.

Shaped exactly as `openai.types` (`Completion`, `ChatCompletion`, `ChatCompletionChunk`,
`Model`) parse them. Ids are `cmpl-<request id>` / `chatcmpl-<request id>`.

Streaming follows OpenAI: one `data: {json}` event per chunk, then `data: [DONE]`; with
`stream_options.include_usage` a last chunk with empty `choices` carries `usage`:

    data: {"object": "chat.completion.chunk", "choices": [{"delta": {"role": "assistant", "content": ""}, ...}]}
    data: {... "choices": [{"delta": {"content": "Hel"}, "finish_reason": null, ...}]}
    data: {... "choices": [{"delta": {}, "finish_reason": "stop", ...}]}
    data: {... "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}}
    data: [DONE]
"""

import json
import time
import uuid

SSE_DONE = b"data: [DONE]\n\n"
OWNED_BY = "s3serve"


def new_request_id() -> str:
    """A fresh request id (32 hex digits); responses prefix it with cmpl-/chatcmpl-."""
    return uuid.uuid4().hex


def _response_id(prefix: str, request_id: str) -> str:
    return request_id if request_id.startswith(prefix) else prefix + request_id


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    """The `usage` object of a response; `prompt_tokens_details.cached_tokens`, the prompt tokens whose KV came from
    the prefix cache, as OpenAI reports them (vLLM only under --enable-prompt-tokens-details)."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                      stop_reason: str | int | None = None) -> dict:
    """One choice of a `text_completion` (finish_reason "stop" or "length"; None in a streamed chunk before the
    end); `logprobs` in OpenAI's completion form (`cluster.ingress.logprob_format`); once finished, vLLM's
    `stop_reason` (the stop string or token id that ended it, None for the model's own end or the limit)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return choice if finish_reason is None else choice | {"stop_reason": stop_reason}


def completion_response(request_id: str, model: str, choices: list[dict], usage: dict, created_s: int) -> dict:
    """A non-streamed `text_completion` (id `cmpl-<request_id>`) of `completion_choice`s."""
    return {
        "id": _response_id("cmpl-", request_id),
        "object": "text_completion",
        "created": created_s,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def completion_chunk(
    request_id: str,
    model: str,
    text: str | None,
    finish_reason: str | None,
    created_s: int,
    usage: dict | None = None,
    index: int = 0,
    logprobs: dict | None = None,
    stop_reason: str | int | None = None,
) -> dict:
    """One streamed `text_completion` chunk (the last of a choice with its `stop_reason`).

    With `usage` and no text or finish_reason, this is OpenAI's last usage chunk (empty
    `choices`); with `usage` and a choice, the usage rides along on that chunk.
    """
    chunk = {"id": _response_id("cmpl-", request_id), "object": "text_completion", "created": created_s, "model": model}
    if usage is not None and not text and finish_reason is None:
        chunk["choices"] = []
    else:
        chunk["choices"] = [completion_choice(index, text or "", finish_reason, logprobs, stop_reason)]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def completion_usage_chunk(request_id: str, model: str, created_s: int, usage: dict) -> dict:
    """The last chunk of a streamed completion under `include_usage`: no choices, the usage."""
    return completion_chunk(request_id, model, None, None, created_s, usage=usage)


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None, text_besides_calls: str | None = None,
                reasoning: str | None = None, stop_reason: str | int | None = None) -> dict:
    """One assistant message of a `chat.completion`; `logprobs` in OpenAI's chat form ({"content": [...]}); with
    `tool_calls`, the message carries them, and as content only the text besides them; a reasoning model's thinking
    under vLLM's two names, `reasoning_content` and `reasoning`; vLLM's `stop_reason` (as in `completion_choice`)."""
    message = {"role": "assistant", "content": text} if tool_calls is None else {
        "role": "assistant", "content": text_besides_calls, "tool_calls": tool_calls}
    if reasoning is not None:
        message |= {"reasoning_content": reasoning, "reasoning": reasoning}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_response(request_id: str, model: str, choices: list[dict], usage: dict, created_s: int) -> dict:
    """A non-streamed `chat.completion` (id `chatcmpl-<request_id>`) of `chat_choice`s."""
    return {
        "id": _response_id("chatcmpl-", request_id),
        "object": "chat.completion",
        "created": created_s,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def chat_chunk(
    request_id: str,
    model: str,
    delta_text: str | None,
    finish_reason: str | None,
    created_s: int,
    role: str | None = None,
    usage: dict | None = None,
    index: int = 0,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
    stop_reason: str | int | None = None,
) -> dict:
    """One `chat.completion.chunk` (of choice `index`); `tool_calls` ride in the delta with their positions, a
    reasoning model's thinking under `reasoning_content` and `reasoning`.

    The first chunk of a stream carries `role="assistant"` (and usually `delta_text=""`),
    the last one a finish_reason with an empty delta. With `usage` and no delta, role or
    finish_reason, this is OpenAI's last usage chunk (empty `choices`).
    """
    chunk = {
        "id": _response_id("chatcmpl-", request_id),
        "object": "chat.completion.chunk",
        "created": created_s,
        "model": model,
    }
    if (usage is not None and not delta_text and role is None and finish_reason is None and tool_calls is None
            and reasoning is None):
        chunk["choices"] = []
    else:
        delta = {}
        if role is not None:
            delta["role"] = role
        if delta_text is not None:
            delta["content"] = delta_text
        if reasoning is not None:
            delta |= {"reasoning_content": reasoning, "reasoning": reasoning}
        if tool_calls is not None:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        chunk["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                             **({} if finish_reason is None else {"stop_reason": stop_reason})}]
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_usage_chunk(request_id: str, model: str, created_s: int, usage: dict) -> dict:
    """The last chunk of a streamed chat completion under `include_usage`."""
    return chat_chunk(request_id, model, None, None, created_s, usage=usage)


def sse_event(payload: dict) -> bytes:
    """One server-sent event: `data: <compact json>` and a blank line."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def models_response(model_ids: list[str], created_s: int, max_model_len: int | None = None) -> dict:
    """The body of `GET /v1/models`; with `max_model_len`, each model says it (as vLLM's does)."""
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    data = [{"id": model_id, "object": "model", "created": created_s, "owned_by": OWNED_BY, **extra}
            for model_id in model_ids]
    return {"object": "list", "data": data}


def openai_finish_reason(reason: str | None) -> str:
    """The engine's finish reason as OpenAI's: "length", else "stop"."""
    return "length" if reason == "length" else "stop"


def created_unix_s(start_s: float) -> int:
    """Unix time of a request that started at monotonic `start_s` (a response's `created`)."""
    return int(time.time() - (time.monotonic() - start_s))
