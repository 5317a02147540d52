"""`/v1/completions` and `/v1/chat/completions` once the body is parsed: prompts to token ids, sampling settings,
one length prediction per prompt, the choices run (`ChoiceRun`), and the answer as one JSON body or as SSE.

    request -> prompts (chat: one) -> per prompt: SamplingParams, predict -> n (or best_of) GenerationJobs
            -> ChoiceRun -> (index, WorkEvent) -> ChoiceAnswer per choice -> body or chunks
"""

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace

import redis
from fastapi.responses import JSONResponse

from cluster.config import ServiceConfig
from cluster.control.messages import PlacementTimeoutError, QueueFullError
from cluster.ingress import openai_protocol as protocol
from cluster.ingress.chat_messages import template_options
from cluster.ingress.choice_answer import AnswerShape, ChoiceAnswer
from cluster.ingress.choices import ChoiceRun, StartJob
from cluster.ingress.errors import APIError, bad_request, queue_full, unavailable
from cluster.ingress.event_stream import EventStream
from cluster.ingress.generation import LOST_ACTOR_ERRORS, GenerationJob, GenerationResult
from cluster.ingress.metrics import ServiceMetrics
from cluster.ingress.openai_responses import created_unix_s, openai_finish_reason
from cluster.ingress.request_sampling import sampling_params
from cluster.ingress.tool_calls import auto_parser, template_messages, tool_choice
from cluster.ingress.unknown_fields import IGNORED_FIELDS_HEADER, header_value
from predictor_service.length_example import constrained_text, join_messages
from workers.engine.models import ChatTemplateError, chat_token_ids
from workers.scheduling.prefix_cache import block_hashes
from workers.values.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_PLACEMENT_PREFIX_BLOCKS = 64  # leading prompt blocks whose hashes go with a placement
OVERHEAD_HEADER = "x-s3-overhead-ms"  # router + predictor + placement, without time queued for KV room
PREDICT_HEADER = "x-s3-predict-ms"  # the predictor calls
PLACE_HEADER = "x-s3-place-ms"  # the first choice's controller call, without time queued for KV room


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str  # what the length predictor reads (chat: the messages joined as it was trained)
    echo_text: str  # what echo puts in front of the answer
    token_ids: tuple[int, ...]
    ignored: tuple[str, ...] = ()  # what the request set that the chat template never reads (named in a header)


def _nth_seed(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s settings: with a seed, seed + index (as vLLM seeds `n` choices), else unchanged (each
    choice then draws its own)."""
    if params.seed is None or index == 0:
        return params
    return replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)  # stays a 64-bit seed


class Completions:
    """Serves both generation endpoints for one router replica.

    Args:
        predict: async (request id, prompt text, prompt tokens, SamplingParams) -> (bound, point) tokens.
        start_job: (GenerationJob, GenerationResult) -> its worker events (`run_job` through the controller).
        prefix_root: the salt of the workers' prefix-cache hashes (placement compares with what they report).
    """

    def __init__(self, config: ServiceConfig, tokenizer, metrics: ServiceMetrics, predict, start_job: StartJob,
                 prefix_root: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._predict = predict
        self._start_job = start_job
        self._prefix_root = prefix_root
        self.num_in_flight = 0

    async def answer(self, req, is_chat: bool, client_request_id: str | None = None, ignored_fields: tuple = ()):
        """The response to a parsed request: JSONResponse or EventStream; APIError for what cannot be served.

        `client_request_id` (the body's `request_id`, else an X-Request-Id header) names the response: its id is
        "chatcmpl-" or "cmpl-" and it. The jobs keep ids of their own, unique whatever clients send.
        `ignored_fields`, with what the chat template never reads, is named in the x-s3-ignored-fields header."""
        start_s = time.monotonic()
        prompts = ([self._encode_chat(req)] if is_chat else
                   [self._encode(p, req.add_special_tokens is not False) for p in protocol.prompts(req)])
        forced = tool_choice(req) if is_chat else None
        tool_parser = auto_parser(req, self.tokenizer, self.config.tool_call_parser) if is_chat else None
        # Mistral's [TOOL_CALLS] is a special token: kept in the text that parser reads, as vLLM keeps it.
        skip_special_tokens = req.skip_special_tokens is not False and tool_parser != "mistral"
        params = [self._sampling(req, len(prompt.token_ids), is_chat, skip_special_tokens) for prompt in prompts]
        # An answer under a grammar (a forced call, structured output) has no think block to split off.
        thinks = is_chat and params[0].grammar is None
        shape = AnswerShape(is_chat, req.stop_sequences, bool(req.logprobs) if is_chat else req.logprobs is not None,
                            echo=not is_chat and req.echo, score_only=not is_chat and req.max_tokens == 0,
                            tool_choice=None if forced in (None, "none") else forced,
                            one_call=is_chat and req.parallel_tool_calls is False, tool_parser=tool_parser,
                            reasoning_parser=self.config.reasoning_parser if thinks else None,
                            include_stop=bool(req.include_stop_str_in_output),
                            stop_token_ids=tuple(req.stop_token_ids or ()), skip_special_tokens=skip_special_tokens)
        if self.num_in_flight >= self.config.max_concurrent_requests:
            raise queue_full(retry_after_s=1)
        self.num_in_flight += 1  # taken before any await, so a burst cannot slip past the limit
        prefix = "chatcmpl" if is_chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        response_id = request_id if client_request_id is None else f"{prefix}-{client_request_id}"
        events = None
        try:
            predict_start_s = time.monotonic()
            groups = list(await asyncio.gather(*(self._jobs(req, request_id, p, prompt, sampling, is_chat)
                                                 for p, (prompt, sampling) in enumerate(zip(prompts, params)))))
            predict_s = time.monotonic() - predict_start_s
            run = ChoiceRun(groups, self._start_job)
            events = run.events()
            first = await self._first_event(events)
        except BaseException:
            self.num_in_flight -= 1
            if events is not None:
                await events.aclose()
            raise
        leader = run.results[0]
        overhead_s = (leader.placed_s or time.monotonic()) - start_s - leader.queued_s
        self.metrics.observe_overhead(overhead_s)
        # Router + predictor + placement time, for load generators measuring the service's own cost.
        headers = {OVERHEAD_HEADER: f"{overhead_s * 1000:.3f}", PREDICT_HEADER: f"{predict_s * 1000:.3f}",
                   PLACE_HEADER: f"{leader.place_call_s * 1000:.3f}"}
        ignored = [*ignored_fields, *(name for prompt in prompts for name in prompt.ignored)]
        if ignored:
            headers[IGNORED_FIELDS_HEADER] = header_value(ignored)
        answers = [ChoiceAnswer(self.tokenizer, shape, prompt.echo_text, prompt.token_ids)
                   for group, prompt in zip(groups, prompts) for _ in group]
        if req.stream:
            async def release() -> None:  # when the response ends, however it ends (the body may never have run)
                self.num_in_flight -= 1
                await events.aclose()  # a no-op once the generation finished

            body = self._sse(req, is_chat, response_id, run, events, first, answers, start_s)
            return EventStream(body, headers=headers, on_close=release)
        return JSONResponse(await self._collect(req, is_chat, response_id, run, events, first, answers, start_s),
                            headers=headers)

    # -- a request's prompts and jobs ------------------------------------------------------------

    def _encode_chat(self, req) -> Prompt:
        messages, tools = template_messages(req, protocol.chat_messages(req), self.tokenizer)
        add_generation_prompt, continue_final_message, template_kwargs = template_options(req)
        template = getattr(self.tokenizer, "chat_template", None)
        # A variable the template never reads changes nothing (vLLM drops it too): named in the ignored-fields header.
        unread = tuple(name for name in template_kwargs if isinstance(template, str) and name not in template)
        try:
            ids = chat_token_ids(self.tokenizer, messages, tools, add_generation_prompt, continue_final_message,
                                 template_kwargs)
        except ChatTemplateError as error:  # none, or it refused these messages
            raise bad_request(str(error), "messages") from None
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "messages")
        ignored = tuple(name if name == "reasoning_effort" else f"chat_template_kwargs.{name}" for name in unread)
        return Prompt(join_messages(messages), "", tuple(ids), ignored)  # joined as the predictor was trained

    def _encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> Prompt:
        """A completion prompt: token ids as sent, text tokenized with the tokenizer's own special tokens (BOS where
        its setting adds one, as vLLM does) unless `add_special_tokens` is false."""
        if isinstance(prompt, list):  # token ids: the text only feeds the length predictor and echo
            if max(prompt) >= len(self.tokenizer):
                raise bad_request(f"prompt token ids must be below the vocabulary size {len(self.tokenizer)}", "prompt")
            text = self.tokenizer.decode(prompt)
            return Prompt(text, text, tuple(prompt))
        ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt")
        return Prompt(prompt, prompt, tuple(ids))

    def _sampling(self, req, num_prompt_tokens: int, is_chat: bool, skip_special_tokens: bool = True):
        return sampling_params(req, num_prompt_tokens, is_chat, self.config.max_model_len,
                               self.config.default_max_tokens, len(self.tokenizer), skip_special_tokens)

    async def _jobs(self, req, request_id: str, index: int, prompt: Prompt, params, is_chat: bool
                    ) -> list[GenerationJob]:
        """The prompt's n (or best_of) jobs, the first one the leader its siblings are placed beside."""
        count = max(req.n, 0 if is_chat else req.best_of or 0)
        one_job = count == 1 and index == 0 and (is_chat or len(protocol.prompts(req)) == 1)
        ids = [request_id] if one_job else [f"{request_id}-{index}-{i}" for i in range(count)]
        text = constrained_text(prompt.text, params.grammar.format if params.grammar else None)
        try:
            bound, point = await self._predict(ids[0], text, len(prompt.token_ids), params)
        except Exception as error:  # noqa: BLE001 - any predictor failure is an outage, not bad input
            logger.exception("predictor failed")
            raise unavailable(f"length predictor ({type(error).__name__})") from None
        hashes = self._prefix_hashes(prompt.token_ids)
        # Siblings wait for the first and follow it where they can share its cached prompt blocks.
        shares = self.config.prefix_caching and params.prompt_logprobs is None
        return [GenerationJob(job_id, text, prompt.token_ids, _nth_seed(params, i),
                              min(bound, params.max_tokens), point, req.priority, hashes,
                              sibling_of=ids[0] if i and shares else None)
                for i, job_id in enumerate(ids)]

    def _prefix_hashes(self, prompt_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The prompt's leading block hashes, for prefix-aware placement (none when it is off)."""
        if not (self.config.prefix_caching and self.config.prefix_aware_placement):
            return ()
        return tuple(block_hashes(list(prompt_ids), self.config.block_size, self._prefix_root,
                                  MAX_PLACEMENT_PREFIX_BLOCKS))

    async def _first_event(self, events):
        """Wait for placement and the first tokens, so admission errors are HTTP errors, not broken streams."""
        try:
            return await events.__anext__()
        except StopAsyncIteration:
            return None
        except QueueFullError:
            raise queue_full(retry_after_s=2) from None
        except PlacementTimeoutError as error:
            raise unavailable(str(error)) from None
        except (*LOST_ACTOR_ERRORS, ConnectionError) as error:
            raise unavailable(f"controller ({type(error).__name__})") from None
        except redis.exceptions.RedisError as error:  # the controller's state store is down
            raise unavailable(f"controller state store ({type(error).__name__})") from None

    # -- answers ----------------------------------------------------------------------------------

    def _observe(self, job: GenerationJob, result: GenerationResult, start_s: float) -> None:
        num_out = len(result.output_token_ids)
        finish_s = result.finish_s or time.monotonic()
        first_s = result.first_token_s or finish_s
        tpot = (finish_s - first_s) / (num_out - 1) if num_out > 1 else None
        self.metrics.observe_finished(first_s - start_s, tpot, finish_s - start_s, job.point_output_tokens, num_out,
                                      job.priority, len(job.prompt_token_ids),
                                      openai_finish_reason(result.finish_reason), result.queued_s)

    @staticmethod
    def _finish_reason(answer: ChoiceAnswer, result: GenerationResult) -> str:
        """OpenAI's finish reason; scoring a prompt (max_tokens 0) ends at the limit whatever token came; a complete
        forced call is "tool_calls" ("stop" when the request named the function, as OpenAI answers)."""
        if answer.shape.score_only:
            return "length"
        if answer.tool_calls is not None and result.finish_reason == "stop":  # a call cut by the limit: "length"
            return "stop" if answer.shape.tool_choice not in ("required", "auto") else "tool_calls"
        return openai_finish_reason(result.finish_reason)

    def _usage(self, run: ChoiceRun, answers: list[ChoiceAnswer]) -> dict:
        """Each prompt counted once (with the cached tokens of its first choice, known once that finished)."""
        num_prompt, num_cached, first = 0, 0, 0
        for group in run.groups:
            num_prompt += len(group[0].prompt_token_ids)
            num_cached += run.results[first].num_cached_prompt_tokens
            first += len(group)
        return protocol.usage(num_prompt, sum(answer.num_tokens for answer in answers), num_cached)

    async def _collect(self, req, is_chat: bool, request_id: str, run: ChoiceRun, events, first, answers,
                       start_s: float) -> dict:
        items = [] if first is None else [first]
        try:
            async for item in events:
                items.append(item)
        except Exception as error:  # noqa: BLE001 - nothing is sent yet: a 503 to retry, as a stream reports in-band
            logger.exception("generation of %s failed", request_id)
            raise unavailable(f"worker serving the request ({type(error).__name__})") from None
        finally:
            self.num_in_flight -= 1
        # Decoded once the generation is in: a detokenizer error is our bug (a 500), not a worker's to retry.
        for index, event in items:
            if event is None:
                answers[index].finish(run.results[index].finish_reason)
                self._observe(run.jobs[index], run.results[index], start_s)
            else:
                answers[index].push(event)
        choices, first_choice = [], 0
        for group in run.groups:
            members = range(first_choice, first_choice + len(group))
            first_choice += len(group)
            if len(group) > req.n:  # best_of: the n of highest mean logprob, best first
                members = sorted(members, key=lambda i: answers[i].mean_logprob, reverse=True)[:req.n]
            for i in members:
                reason = self._finish_reason(answers[i], run.results[i])
                if is_chat:
                    choices.append(protocol.chat_choice(len(choices), answers[i].whole_text, reason,
                                                        answers[i].logprobs, answers[i].tool_calls,
                                                        answers[i].text_besides_calls, answers[i].reasoning,
                                                        answers[i].stop_reason(run.results[i].finish_reason)))
                else:
                    choices.append(protocol.completion_choice(len(choices), answers[i].whole_text, reason,
                                                              answers[i].logprobs,
                                                              answers[i].stop_reason(run.results[i].finish_reason)))
                if req.return_token_ids:  # vLLM's: the ids, so that a trainer need not tokenize the text again
                    choices[-1]["token_ids"] = answers[i].token_ids
                    if not is_chat:
                        choices[-1]["prompt_token_ids"] = list(run.jobs[i].prompt_token_ids)
                if req.prompt_logprobs is not None and not is_chat:
                    choices[-1]["prompt_logprobs"] = answers[i].prompt_logprobs
        self.metrics.observe_status("ok")
        response = protocol.chat_response if is_chat else protocol.completion_response
        body = response(request_id, self.config.model_id, choices, self._usage(run, answers), created_unix_s(start_s))
        if req.return_token_ids and is_chat:
            body["prompt_token_ids"] = list(run.jobs[0].prompt_token_ids)
        if req.prompt_logprobs is not None and is_chat:
            body["prompt_logprobs"] = answers[0].prompt_logprobs
        return body

    async def _sse(self, req, is_chat: bool, request_id: str, run: ChoiceRun, events, first, answers,
                   start_s: float):
        model_id, created_s = self.config.model_id, created_unix_s(start_s)

        def chunk(index: int, delta: str | None, reason: str | None, role: str | None = None,
                  logprobs: dict | None = None, reasoning: str | None = None, stop_reason=None,
                  token_ids: tuple[int, ...] = (), tool_calls: list[dict] | None = None) -> bytes:
            if is_chat:
                payload = protocol.chat_chunk(request_id, model_id, delta, reason, created_s, role=role, index=index,
                                              logprobs=logprobs, reasoning=reasoning, stop_reason=stop_reason,
                                              tool_calls=tool_calls)
            else:
                payload = protocol.completion_chunk(request_id, model_id, delta or "", reason, created_s, index=index,
                                                    logprobs=logprobs, stop_reason=stop_reason)
            if req.continuous_usage and payload.get("choices"):
                payload["usage"] = self._usage(run, answers)
            if req.return_token_ids:  # vLLM's: each chunk's token ids; the first of a choice, its prompt's
                payload["choices"][0]["token_ids"] = list(token_ids)
                if role is not None or (not is_chat and index not in prompt_sent):
                    prompt_sent.add(index)
                    (payload if is_chat else payload["choices"][0])["prompt_token_ids"] = list(
                        run.jobs[index].prompt_token_ids)
            return protocol.sse_event(payload)

        prompt_sent: set[int] = set()

        async def all_events():
            if first is not None:
                yield first
            async for item in events:
                yield item

        try:
            if is_chat:
                for index in range(len(answers)):
                    yield chunk(index, "", None, role="assistant")
            async for index, event in all_events():
                answer = answers[index]
                if event is not None:
                    delta, logprobs = answer.push(event)
                    reasoning, delta = answer.split(delta)
                    calls = None
                    if answer.shape.tool_choice is not None:  # the text besides the calls; each call as it comes
                        delta, calls = answer.stream_calls(delta)
                    if delta or logprobs or reasoning or calls or req.return_token_ids:
                        yield chunk(index, delta or ("" if not calls else None), None, logprobs=logprobs,
                                    reasoning=reasoning or None, token_ids=event.token_ids, tool_calls=calls or None)
                    continue
                result = run.results[index]
                reasoning, tail = answer.split(answer.finish(result.finish_reason), final=True)
                if reasoning:
                    yield chunk(index, "", None, reasoning=reasoning)
                if answer.shape.tool_choice is not None:
                    content, calls = answer.finish_calls()
                    if content or calls:
                        yield chunk(index, content or None, None, tool_calls=calls or None)
                elif tail:
                    yield chunk(index, tail, None)
                yield chunk(index, None if is_chat else "", self._finish_reason(answer, result),
                            stop_reason=answer.stop_reason(result.finish_reason))
                self._observe(run.jobs[index], result, start_s)
            if req.include_usage:
                builder = protocol.chat_usage_chunk if is_chat else protocol.completion_usage_chunk
                yield protocol.sse_event(builder(request_id, model_id, created_s, self._usage(run, answers)))
            yield protocol.SSE_DONE
            self.metrics.observe_status("ok")
        except Exception as error:  # noqa: BLE001 - headers are sent: report in-band, OpenAI style
            # (a detokenizer error, our bug, reads the same here: the client already has part of the answer)
            logger.exception("stream of %s failed", request_id)
            self.metrics.observe_status("error")
            yield protocol.sse_event(APIError(503, f"generation failed ({type(error).__name__}); retry the request",
                                              "server_error").body())
