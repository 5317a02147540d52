"""OpenAI-compatible request bodies of the router, and its one import for the wire format.

Requests are pydantic models (the HTTP edge): strict types, so `"max_tokens": "10"` or
`true` is a 400 rather than a silent coercion; `null` means the default wherever OpenAI's
spec makes a field nullable (openai-python sends `"temperature": null` for
`temperature=None`); unknown fields are ignored because the official clients send some we
do not use, and named (`cluster.ingress.unknown_fields`: a response header, a log line, a 400
under strict_request_fields); parameters we do not implement (beam search, OpenAI's deprecated functions) are
rejected when set to anything but their default, never silently dropped. OpenAI's logit_bias,
penalties, logprobs, echo, n and best_of, several prompts per completion request, structured
output (response_format, vLLM's guided_* and structured_outputs), tools, and vLLM's sampling
extras (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids) are served. The response builders live
in `cluster/ingress/openai_responses.py` and are re-exported here, so the router imports the
whole protocol from one place.
"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationInfo
from pydantic import field_validator, model_validator

from cluster.ingress.openai_responses import (
    SSE_DONE,
    chat_choice,
    chat_chunk,
    chat_response,
    chat_usage_chunk,
    completion_choice,
    completion_chunk,
    completion_response,
    completion_usage_chunk,
    models_response,
    new_request_id,
    sse_event,
    usage,
)
from cluster.ingress.chat_messages import RESERVED_TEMPLATE_ARGUMENTS, ChatMessage, FunctionSpec, ToolSpec
from cluster.ingress.unsupported_params import (CHAT_UNSUPPORTED, COMPLETION_UNSUPPORTED, SHARED_UNSUPPORTED,
                                                 reject_non_default)
from workers.values.sampling_params import MAX_LOGPROBS

__all__ = [
    "MAX_STOP_SEQUENCES", "SSE_DONE", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "FunctionSpec",
    "StreamOptions", "ToolSpec",
    "chat_choice", "chat_chunk", "chat_messages", "chat_response", "chat_usage_chunk", "completion_choice",
    "completion_chunk", "completion_response", "completion_usage_chunk", "models_response", "new_request_id",
    "prompts", "requested_max_tokens", "sse_event", "usage",
]

# OpenAI accepts at most 4 stop sequences, vLLM any number (lm-eval's HumanEval sends 5): this bound only guards the
# router's per-token stop matching, far above what harnesses send.
MAX_STOP_SEQUENCES = 256
# Sequences one request may start (prompts x max(n, best_of)): each is its own placement and KV reservation.
MAX_CHOICES = 64
# torch.Generator.manual_seed takes 64-bit seeds; anything wider would fail deep in a worker.
_SEED_BOUNDS = {"ge": -(2**63), "le": 2**63 - 1}

# OpenAI's nullable fields that we type strictly: null means the field's default.
_NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "stream")

MaxTokens = Annotated[StrictInt, Field(ge=1)]
Logprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
NumChoices = Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)]
Temperature = Annotated[StrictFloat, Field(ge=0.0, le=2.0)]
TopP = Annotated[StrictFloat, Field(gt=0.0, le=1.0)]
Seed = Annotated[StrictInt, Field(**_SEED_BOUNDS)]
Priority = Annotated[StrictInt, Field(ge=-100, le=100)]  # lower is more urgent
Penalty = Annotated[StrictFloat, Field(ge=-2.0, le=2.0)]
TokenId = Annotated[StrictInt, Field(ge=0)]
ClientRequestId = Annotated[StrictStr, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]


def _check_stop(value: Any) -> Any:
    if value is None or isinstance(value, str) and value:
        return value
    if (
        isinstance(value, list)
        and len(value) <= MAX_STOP_SEQUENCES
        and all(isinstance(item, str) and item for item in value)
    ):
        return value
    raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings")


class StreamOptions(BaseModel):
    """Options of a streamed response.

    Attributes:
        include_usage: send a last chunk with empty `choices` and the request's `usage`.
        continuous_usage_stats: vLLM's: every chunk also carries the usage so far.
    """

    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints; see the subclasses for their meaning."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    model: StrictStr
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    n: NumChoices = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Seed | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool = False
    forced_output_tokens: MaxTokens | None = None
    priority: Priority = 0
    logit_bias: dict[StrictStr, Annotated[StrictFloat, Field(ge=-100.0, le=100.0)]] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[StrictFloat, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[StrictFloat, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: StrictBool | None = None  # vLLM's: the stop string that ends the text stays in it
    # Structured output (`cluster.ingress.structured_request` reads and checks them, naming the field it refuses):
    # OpenAI's, and vLLM's two spellings.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: StrictStr | None = None
    guided_choice: Any = None
    guided_grammar: StrictStr | None = None
    structured_outputs: Any = None
    guided_decoding_backend: Literal["auto", "llguidance", "guidance"] | None = None  # the one we run
    guided_whitespace_pattern: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: Logprobs | None = None  # vLLM's: each prompt token's logprob and this many alternatives
    allowed_token_ids: Any = None
    bad_words: Any = None
    truncate_prompt_tokens: Any = None
    skip_special_tokens: StrictBool | None = None  # vLLM's: false keeps special tokens in the text
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    # vLLM's: a text prompt gets the tokenizer's own special tokens (BOS where it adds one) unless false
    add_special_tokens: StrictBool | None = None
    cache_salt: Any = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    return_token_ids: StrictBool | None = None  # vLLM's: prompt and answer token ids in the response
    mm_processor_kwargs: Any = None
    service_tier: Any = None
    # NO_EFFECT: accepted, no effect on the answer
    metadata: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # vLLM's: the response's id is "chatcmpl-" / "cmpl-" and this (an X-Request-Id header takes precedence)
    request_id: ClientRequestId | None = None

    @field_validator(*_NULL_MEANS_DEFAULT, mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if value is None else value

    # The endpoint's parameters accepted only at their default (each subclass adds its own).
    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = SHARED_UNSUPPORTED

    @field_validator(*{**SHARED_UNSUPPORTED, **COMPLETION_UNSUPPORTED, **CHAT_UNSUPPORTED}, mode="before",
                     check_fields=False)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_non_default(value, info, cls.unsupported)

    @field_validator("stop", mode="before")
    @classmethod
    def _valid_stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict | None) -> dict | None:
        if value is not None and any(not key.isdigit() for key in value):
            raise ValueError("logit_bias keys must be token ids (decimal strings such as \"50256\")")
        return value

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, sorted by token id."""
        return tuple(sorted((int(key), float(value)) for key, value in (self.logit_bias or {}).items()))

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs come with a whole response here, not a stream: set stream false")
        return self

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        """The stop strings as a tuple (empty when none)."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's stream_options.continuous_usage_stats)."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """Body of `POST /v1/completions`.

    Attributes:
        model: id of a served model (an unknown id is a 404, decided by the router).
        prompt: the prompt as text or as token ids, or a list of those (each prompt gets n choices, indexed
            prompt by prompt).
        max_tokens: most tokens to generate; None means the service default; 0 only with echo (score the prompt).
        temperature: sampling temperature in [0, 2]; 0 is greedy.
        top_p: nucleus mass in (0, 1].
        n: choices per prompt, each its own sequence (its own placement and length prediction; on one worker
            they share the prompt's cached KV blocks).
        best_of: generate this many per prompt (>= n, not with stream) and return the n of highest mean logprob.
        echo: the answer text starts with the prompt (with logprobs: the prompt tokens' logprobs too).
        logprobs: each token's logprob and the logprobs most likely tokens (0 to 20).
        stream: answer with server-sent events.
        stream_options: streaming options (only with stream).
        stop: up to 256 stop strings; the output ends before the first match.
        seed: sampling seed, for reproducible samples.
        ignore_eos: extension: generate exactly max_tokens tokens (benchmarks).
        forced_output_tokens: extension: finish after exactly this many tokens (<= max_tokens), so
            a benchmark fixes the work while max_tokens (what max_reserve reserves) stays large.
        priority: extension: the request's class, an integer in [-100, 100], lower is more urgent
            (default 0): admitted first, preempted last, placed first.
        user: end-user id, recorded only.
        logit_bias, presence_penalty, frequency_penalty: OpenAI's; top_k, min_p, repetition_penalty,
            min_tokens, stop_token_ids: vLLM's (see `workers.values.sampling_params.SamplingParams`).
    """

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {**SHARED_UNSUPPORTED, **COMPLETION_UNSUPPORTED}
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False  # before max_tokens and best_of, whose checks read it
    logprobs: Logprobs | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    best_of: NumChoices | None = None
    suffix: Any = None

    @field_validator("echo", mode="before")
    @classmethod
    def _null_is_no_echo(cls, value: Any) -> Any:
        return False if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def _non_empty_prompts(cls, value: Any) -> Any:
        if isinstance(value, str) and value or _is_token_ids(value):
            return value
        if (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                and (all(isinstance(item, str) and item for item in value) or all(map(_is_token_ids, value)))):
            return value
        raise ValueError(f"prompt must be a non-empty string or non-empty list of token ids (>= 0), or a list of "
                         f"1 to {MAX_CHOICES} of one of those")

    @field_validator("max_tokens")
    @classmethod
    def _zero_only_to_score(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens 0 is only allowed with echo (scoring the prompt)")
        return value

    @field_validator("best_of")
    @classmethod
    def _at_least_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"best_of ({value}) must be at least n ({n})")
        if value is not None and value > n and info.data.get("stream"):
            raise ValueError("best_of above n cannot be streamed (the best are known only at the end)")
        return value

    @model_validator(mode="after")
    def _choices(self):
        if len(prompts(self)) * max(self.n, self.best_of or 1) > MAX_CHOICES:
            raise ValueError(f"prompts x max(n, best_of) is over {MAX_CHOICES} sequences per request")
        return self


class ChatCompletionRequest(_SamplingRequest):
    """Body of `POST /v1/chat/completions`.

    Attributes:
        messages: the conversation, at least one message.
        max_tokens: most tokens to generate (older name); None means the service default.
        max_completion_tokens: same as max_tokens (newer name); set one, or both equal.
        logprobs: each answer token's logprob; top_logprobs (0 to 20, needs logprobs): the most likely tokens too.
        The remaining fields mean what they mean in `CompletionRequest`.
    """

    unsupported: ClassVar[dict[str, tuple[Any, ...]]] = {**SHARED_UNSUPPORTED, **CHAT_UNSUPPORTED}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Logprobs | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Any = None  # read by `cluster.ingress.tool_calls`, which names what it refuses
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: StrictBool | None = None  # honoured: one call per answer is within what it allows
    # vLLM's chat-template controls (`chat_messages.template_options`): open the assistant's turn (default true),
    # or continue the last message, an assistant's, instead; extra variables for the template
    continue_final_message: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    chat_template: Any = None
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    documents: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: StrictStr | None = None  # given to a chat template that reads it, as vLLM does
    store: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    echo: Any = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _null_is_no_logprobs(cls, value: Any) -> Any:
        return False if value is None else value

    @model_validator(mode="after")
    def _one_max_tokens(self):
        if self.top_logprobs and not self.logprobs:  # 0 is the default, as vLLM reads it
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the answer either "
                             "continues the last message or opens a new turn")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's, to continue")
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}: the request's own "
                             "fields set them")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ValueError(
                f"max_tokens ({self.max_tokens}) and max_completion_tokens ({self.max_completion_tokens}) "
                "differ; set only one"
            )
        return self


def _is_token_ids(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in value))


def prompts(req: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts, each a text or a list of token ids (vLLM and OpenAI take both)."""
    if isinstance(req.prompt, str) or _is_token_ids(req.prompt):
        return [req.prompt]
    return list(req.prompt)


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation as role/content dicts (with tool_calls, tool_call_id, name and an assistant's earlier
    reasoning_content where set), the form chat templates take."""
    return [{"role": message.role, "content": message.content,
             **({"tool_calls": message.tool_calls} if message.tool_calls else {}),
             **({"tool_call_id": message.tool_call_id} if message.tool_call_id else {}),
             **({"name": message.name} if message.name is not None else {}),
             **({"reasoning_content": thinking} if (thinking := message.reasoning_content or message.reasoning)
                else {})} for message in req.messages]


def requested_max_tokens(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The request's output token limit, None when it leaves it to the service."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens
