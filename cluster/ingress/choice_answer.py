"""One choice's answer as its worker events come: text deltas (stop strings cut out) and logprobs in the
endpoint's form, with the prompt in front under `echo` (pure: a tokenizer is passed in)."""

from dataclasses import dataclass

from cluster.ingress.logprob_format import (CompletionLogprobs, chat_logprobs, join_completion_logprobs,
                                            vllm_prompt_logprobs)
from cluster.ingress.reasoning import ReasoningStream, split_reasoning
from cluster.ingress.text_stream import TextStream
from cluster.ingress.tool_call_stream import ToolCallStream
from cluster.ingress.tool_calls import calls_of, text_besides_calls
from workers.values.step_output import TokenLogprob
from workers.values.work_types import WorkEvent


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """What a request asks of every choice's answer.

    Attributes:
        is_chat: chat form (message, {"content": [...]} logprobs) or completion form.
        stop: stop strings, cut from the text.
        logprobs: whether the answer carries its tokens' logprobs.
        echo: completions: the prompt's text (and, with logprobs, its tokens' logprobs) comes first.
        score_only: completions with max_tokens 0: the answer is the echoed prompt alone; the token the worker
            generated (it always generates one) is dropped.
        tool_choice: chat with tools the model may call ("auto", "required" or a function's name): the answer
            is read for tool calls (`cluster.ingress.tool_calls`), streamed as OpenAI streams them
            (`cluster.ingress.tool_call_stream`).
        reasoning_parser: chat: the thinking is split from the answer (`cluster.ingress.reasoning`); tool calls are
            read from the answer besides it.
        include_stop: the stop string that ends the answer stays in it (vLLM's include_stop_str_in_output).
        stop_token_ids: the request's stop tokens, which `stop_reason` names.
        skip_special_tokens: special tokens are left out of the text (vLLM's default; false keeps them).
    """

    is_chat: bool
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    echo: bool = False
    score_only: bool = False
    tool_choice: str | None = None
    one_call: bool = False  # parallel_tool_calls false: the first call only
    tool_parser: str | None = None  # under "auto": the format the calls are read in (`cluster.ingress.tool_parsers`)
    reasoning_parser: str | None = None
    include_stop: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True


class ChoiceAnswer:
    """Accumulates one choice; `push` and `finish` return what a stream sends, `text` and `logprobs` the whole."""

    def __init__(self, tokenizer, shape: AnswerShape, prompt_text: str, prompt_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.shape = shape
        self._prompt_text = prompt_text
        self._prompt_ids = prompt_token_ids
        self._texts = TextStream(tokenizer, shape.stop, shape.include_stop, shape.skip_special_tokens)
        self._offsets = CompletionLogprobs(tokenizer)
        self._parts: list[dict] = []  # completion form, piece by piece
        self._token_logprobs: list[TokenLogprob] = []
        self._started = False
        self._calls: tuple[list[dict] | None] | None = None
        self._reasoning = None if shape.reasoning_parser is None else ReasoningStream(shape.reasoning_parser)
        self._call_stream = None if shape.tool_choice is None else ToolCallStream(
            shape.tool_choice, shape.tool_parser, 1 if shape.one_call else None)
        self.text = ""
        self.num_tokens = 0
        self._prompt_logprobs = None  # what the first event brought, when the request asked for them

    def push(self, event: WorkEvent) -> tuple[str, dict | None]:
        """The text delta and the logprobs (this event's tokens) to send for one worker event."""
        if event.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = event.prompt_logprobs
        head, head_logprobs = self._start(event)
        if self.shape.score_only:
            return head, head_logprobs
        self.num_tokens += len(event.token_ids)
        delta = head + self._texts.push(event.token_ids)
        self.text += delta[len(head):]
        self._token_logprobs.extend(event.logprobs or ())  # best_of ranks by them, asked for or not
        logprobs = None
        if self.shape.logprobs:
            logprobs = self._form(event.logprobs or (), event.token_ids, head_logprobs)
        return delta, logprobs

    def finish(self, finish_reason: str | None) -> str:
        """The rest of the text once the choice ended."""
        if self.shape.score_only:
            return ""
        tail = self._texts.finish(finish_reason == "stop")
        self.text += tail
        return tail

    def split(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of a text delta as a stream sends them (all content without a reasoning parser);
        `final`, for the delta `finish` returned, also gives what was held back."""
        if self._reasoning is None:
            return "", delta
        reasoning, content = self._reasoning.push(delta)
        if final:
            held_reasoning, held_content = self._reasoning.finish()
            reasoning, content = reasoning + held_reasoning, content + held_content
        return reasoning, content

    def stream_calls(self, content: str) -> tuple[str, list[dict]]:
        """Under tools, what a stream sends for a content delta (as `split` gives it): the content besides the calls
        and the calls' deltas."""
        return self._call_stream.push(content)

    def finish_calls(self) -> tuple[str, list[dict]]:
        """Under tools, what a stream still sends once the choice ended, to give the whole answer's reading."""
        calls = self.tool_calls
        return self._call_stream.finish(calls, self.content if calls is None else self.text_besides_calls or "")

    @property
    def prompt_logprobs(self) -> list | None:
        """The prompt's logprobs in vLLM's form, once its first event brought them (None otherwise)."""
        if self._prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self._tokenizer, self._prompt_logprobs, self._prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        """The answer's generated token ids, all of them (a stop string's too)."""
        return list(self._texts.token_ids)

    def stop_reason(self, finish_reason: str | None) -> str | int | None:
        """vLLM's stop_reason: the stop string or stop token id that ended the answer; None when the model's own end
        of sequence or the limit did."""
        if finish_reason != "stop":
            return None
        if self._texts.matched_stop is not None:
            return self._texts.matched_stop
        last = self._texts.token_ids[-1:]
        return last[0] if last and last[0] in self.shape.stop_token_ids else None

    @property
    def reasoning(self) -> str | None:
        """The whole answer's thinking (None without a reasoning parser, or a think block)."""
        return None if self.shape.reasoning_parser is None else split_reasoning(self.shape.reasoning_parser,
                                                                                  self.text)[0]

    @property
    def content(self) -> str:
        """The whole answer besides its thinking."""
        return self.text if self.shape.reasoning_parser is None else split_reasoning(self.shape.reasoning_parser,
                                                                                       self.text)[1]

    @property
    def tool_calls(self) -> list[dict] | None:
        """OpenAI's `tool_calls` of the answer (read once: their ids stay); None for text, or a forced call cut
        short by the limit."""
        if self._calls is None and self.shape.tool_choice is not None:
            calls = calls_of(self.shape.tool_choice, self.content, self.shape.tool_parser)
            self._calls = (calls[:1] if calls and self.shape.one_call else calls,)
        return None if self._calls is None else self._calls[0]

    @property
    def text_besides_calls(self) -> str | None:
        """Under tool_choice "auto", the text outside the calls (None when there is none)."""
        return None if self.shape.tool_choice is None else text_besides_calls(self.shape.tool_choice, self.content,
                                                                               self.shape.tool_parser)

    @property
    def whole_text(self) -> str:
        return (self._prompt_text if self.shape.echo else "") + self.content

    @property
    def logprobs(self) -> dict | None:
        """The whole answer's logprobs in the endpoint's form (None when not asked for)."""
        if not self.shape.logprobs:
            return None
        if self.shape.is_chat:
            return chat_logprobs(self._tokenizer, self._token_logprobs)
        return join_completion_logprobs(self._parts)

    @property
    def mean_logprob(self) -> float:
        """Mean logprob per answer token (best_of ranks by it); -inf without tokens."""
        if not self._token_logprobs:
            return float("-inf")
        return sum(logprob.logprob for logprob in self._token_logprobs) / len(self._token_logprobs)

    def _start(self, event: WorkEvent) -> tuple[str, dict | None]:
        """On the first event: the echoed prompt's text and logprobs (empty and None otherwise)."""
        if self._started or not self.shape.echo:
            self._started = True
            return "", None
        self._started = True
        if not self.shape.logprobs:
            return self._prompt_text, None
        scored = event.prompt_logprobs or (None,) * len(self._prompt_ids)
        part = self._offsets.entries(scored, self._prompt_ids)
        self._parts.append(part)
        return self._prompt_text, part

    def _form(self, logprobs, token_ids, head: dict | None) -> dict:
        if self.shape.is_chat:
            return chat_logprobs(self._tokenizer, logprobs)
        part = self._offsets.entries(logprobs, token_ids)
        self._parts.append(part)
        return part if head is None else join_completion_logprobs([head, part])
