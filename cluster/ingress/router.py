"""The router: Ray Serve ingress with an OpenAI-compatible HTTP API.

Validates, applies the chat template, asks the predictor for a length bound, asks the
controller for a worker with room, and streams the worker's tokens back (SSE or one JSON
body). Bad input is a 4xx with OpenAI's error shape, never a 500.

The FastAPI app is module-level because `serve.ingress` binds routes to a class at
import time; every replica builds its own state in `Router.__init__`.
"""

import asyncio
import json
import logging
import time
import uuid

import ray
import redis
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from ray import serve

from cluster.ingress import openai_protocol as protocol
from cluster.config import ServiceConfig, worker_actor_name
from cluster.control.controller import get_or_create_controller
from cluster.control.messages import PlacementTimeoutError, QueueFullError
from cluster.ingress.cors import install_cors
from cluster.ingress.dashboard import (DASHBOARD_HTML, RouterNumbers, ThroughputMeter, dashboard_data,
                               generated_tokens_by_worker)
from cluster.ingress.errors import (APIError, bad_request, body_too_large, check_api_key, install_error_handlers,
                            not_found_model, queue_full, unavailable, validation_error)
from cluster.ingress.event_stream import EventStream
from cluster.ingress.generation import GenerationJob, GenerationResult, WorkerHandles, run_job
from cluster.ingress.metrics import ServiceMetrics, cluster_snapshot
from cluster.ingress.openai_responses import created_unix_s, openai_finish_reason
from cluster.ingress.predictor_client import DeploymentPredictor, InRouterPredictor
from cluster.ingress.request_sampling import sampling_params
from cluster.ingress.text_stream import TextStream
from cluster.ingress.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize_answer, tokenize_answer
from predictor_service.length_example import join_messages
from workers.models import NoChatTemplate, chat_token_ids, load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
from workers.policies import length_range_tokens, make_policy
from workers.prefix_cache import block_hashes, prefix_cache_salt, salt_hash
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_PLACEMENT_PREFIX_BLOCKS = 64  # leading prompt blocks whose hashes go with a placement
OVERHEAD_HEADER = "x-s3-overhead-ms"  # router + predictor + placement, without time queued for KV room
PREDICT_HEADER = "x-s3-predict-ms"  # the predictor call
PLACE_HEADER = "x-s3-place-ms"  # the controller call, without time queued for KV room

app = FastAPI(title="S3 Serve", docs_url=None, redoc_url=None)
install_error_handlers(app)
install_cors(app)  # off until the router sets app.state.allowed_origins


# Generations outlive Serve's 20 s default drain: a rollout lets the old replica finish its streams.
ROUTER_DRAIN_TIMEOUT_S = 600.0


@serve.deployment(name="router", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000,
                  graceful_shutdown_timeout_s=ROUTER_DRAIN_TIMEOUT_S)
@serve.ingress(app)
class Router:
    """HTTP ingress of the service.

    Args:
        config: `ServiceConfig.model_dump()`.
        redis_url: where the controller keeps its state.
        predictor: handle of the predictor deployment, or None to predict in this replica.
    """

    def __init__(self, config: dict, redis_url: str, predictor=None) -> None:
        self.config = ServiceConfig(**config)
        self.policy = make_policy(self.config.policy)  # which predicted length the workers plan by
        self.predictor = (DeploymentPredictor(predictor) if predictor is not None else
                          InRouterPredictor(self.config.predictor_root, self.config.quantile,
                                            length_range_tokens(self.config.max_model_len), self.config.model))
        model_dir = resolve_model_dir(self.config.model, self.config.model_cache_dir, self.config.revision)
        self.tokenizer = load_tokenizer(resolve_tokenizer_dir(self.config.tokenizer, model_dir,
                                                              self.config.model_cache_dir),
                                        self.config.chat_template)
        # Workers name cached blocks with the same salt, so these hashes match what they report.
        self._prefix_root = salt_hash(prefix_cache_salt(self.config.model, self.config.dtype))
        self.controller = get_or_create_controller(self.config, redis_url)
        # A running controller keeps the config it was created with; a rollout brings the new one.
        self.controller.reconfigure.remote(self.config.model_dump())
        self.workers = WorkerHandles()
        self.metrics = ServiceMetrics(model_name=self.config.model_id)
        app.state.allowed_origins = self.config.allowed_origins
        self.api_keys = frozenset(self.config.api_keys)
        self.num_in_flight = 0
        self.started_s = int(time.time())
        self.throughput = ThroughputMeter()

    # -- helpers -----------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        check_api_key(request.headers.get("authorization"), self.api_keys)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 before it grows past max_body_bytes."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise body_too_large(limit)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, request: Request, model_cls):
        body = await self._read_body(request)
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise bad_request(f"request body is not valid JSON: {error}") from None
        except RecursionError:
            raise bad_request("request body is nested too deeply") from None
        if not isinstance(payload, dict):
            raise bad_request("request body must be a JSON object")
        try:  # JSON may escape (or Python's decoder pass through) lone UTF-16 surrogates; no tokenizer takes them
            json.dumps(payload, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("request body contains an unpaired UTF-16 surrogate (not valid Unicode text)") from None
        except (ValueError, RecursionError):
            raise bad_request("request body is nested too deeply") from None
        try:
            return model_cls.model_validate(payload)
        except ValidationError as error:
            raise validation_error(list(error.errors())) from None

    def _encode_prompt(self, req, is_chat: bool) -> tuple[str, list[int]]:
        if is_chat:
            messages = protocol.chat_messages(req)
            try:
                ids = chat_token_ids(self.tokenizer, messages)
            except NoChatTemplate as error:
                raise bad_request(str(error), "messages") from None
            text = join_messages(messages)  # as the predictor was trained
        elif (ids := protocol.prompt_token_ids(req)) is not None:  # the text only feeds the length predictor
            if max(ids) >= len(self.tokenizer):
                raise bad_request(f"prompt token ids must be below the vocabulary size {len(self.tokenizer)}", "prompt")
            text = self.tokenizer.decode(ids)
        else:
            text = protocol.prompt_text(req)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = list(ids)
        if not ids:
            raise bad_request("the prompt is empty after tokenization", "prompt" if not is_chat else "messages")
        return text, ids

    def _sampling(self, req, num_prompt_tokens: int, is_chat: bool) -> SamplingParams:
        return sampling_params(req, num_prompt_tokens, is_chat, self.config.max_model_len,
                               self.config.default_max_tokens, len(self.tokenizer))

    async def _predict(self, request_id: str, text: str, num_prompt_tokens: int, params: SamplingParams):
        payload = {"prompt_id": request_id, "prompt_text": text, "num_prompt_tokens": num_prompt_tokens,
                   "max_tokens": params.max_tokens, "temperature": params.temperature}
        prediction = await self.predictor.predict(payload)
        point = prediction["point_tokens"]
        return self.policy.prediction_from(point, prediction["upper_bound_tokens"]), point

    # -- generation ----------------------------------------------------------------

    async def _generate(self, request: Request, is_chat: bool):
        req = await self._model_request(request, protocol.ChatCompletionRequest if is_chat
                                        else protocol.CompletionRequest)
        start_s = time.monotonic()
        text, prompt_ids = self._encode_prompt(req, is_chat)
        params = self._sampling(req, len(prompt_ids), is_chat)
        if self.num_in_flight >= self.config.max_concurrent_requests:
            raise queue_full(retry_after_s=1)
        # The slot is taken before any await, so a burst cannot slip past the limit.
        self.num_in_flight += 1
        request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = None
        try:
            try:
                predict_start_s = time.monotonic()
                bound, point = await self._predict(request_id, text, len(prompt_ids), params)
                predict_s = time.monotonic() - predict_start_s
            except Exception as error:  # noqa: BLE001 - any predictor failure is an outage, not bad input
                logger.exception("predictor failed")
                raise unavailable(f"length predictor ({type(error).__name__})") from None
            job = GenerationJob(request_id, text, tuple(prompt_ids), params, min(bound, params.max_tokens), point,
                                req.priority, self._prefix_hashes(prompt_ids))
            result = GenerationResult([])
            stream = run_job(job, self.controller, self.workers, result, worker_actor_name)
            first = await self._first_chunk(stream)
        except BaseException:
            self.num_in_flight -= 1
            if stream is not None:
                await stream.aclose()
            raise
        overhead_s = (result.placed_s or time.monotonic()) - start_s - result.queued_s
        self.metrics.observe_overhead(overhead_s)
        # Router + predictor + placement time, for load generators measuring the service's own cost.
        headers = {OVERHEAD_HEADER: f"{overhead_s * 1000:.3f}", PREDICT_HEADER: f"{predict_s * 1000:.3f}",
                   PLACE_HEADER: f"{result.place_call_s * 1000:.3f}"}
        if req.stream:
            async def release() -> None:  # when the response ends, however it ends (the body may never have run)
                self.num_in_flight -= 1
                await stream.aclose()  # a no-op once the generation finished

            return EventStream(self._sse(req, is_chat, job, stream, first, result, start_s), headers=headers,
                               on_close=release)
        return JSONResponse(await self._collect(is_chat, job, stream, first, result, start_s), headers=headers)

    def _prefix_hashes(self, prompt_ids: list[int]) -> tuple[int, ...]:
        """The prompt's leading block hashes, for prefix-aware placement (none when it is off)."""
        if not (self.config.prefix_caching and self.config.prefix_aware_placement):
            return ()
        return tuple(block_hashes(prompt_ids, self.config.block_size, self._prefix_root, MAX_PLACEMENT_PREFIX_BLOCKS))

    async def _first_chunk(self, stream) -> list[int] | None:
        """Wait for placement and the first tokens, so admission errors are HTTP errors, not broken streams."""
        try:
            return await stream.__anext__()
        except StopAsyncIteration:
            return None
        except QueueFullError:
            raise queue_full(retry_after_s=2) from None
        except PlacementTimeoutError as error:
            raise unavailable(str(error)) from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ConnectionError) as error:
            raise unavailable(f"controller ({type(error).__name__})") from None
        except redis.exceptions.RedisError as error:  # the controller's state store is down
            raise unavailable(f"controller state store ({type(error).__name__})") from None

    def _observe(self, job: GenerationJob, result: GenerationResult, start_s: float) -> None:
        num_out = len(result.output_token_ids)
        finish_s = result.finish_s or time.monotonic()
        first_s = result.first_token_s or finish_s
        tpot = (finish_s - first_s) / (num_out - 1) if num_out > 1 else None
        self.metrics.observe_finished(first_s - start_s, tpot, finish_s - start_s, job.point_output_tokens, num_out,
                                      job.priority, len(job.prompt_token_ids))
        self.metrics.observe_status("ok")

    async def _collect(self, is_chat: bool, job: GenerationJob, stream, first, result: GenerationResult,
                       start_s: float) -> dict:
        chunks = [] if first is None else [first]
        try:
            async for token_ids in stream:
                chunks.append(token_ids)
        except Exception as error:  # noqa: BLE001 - nothing is sent yet: a 503 to retry, as a stream reports in-band
            logger.exception("generation of %s failed", job.request_id)
            raise unavailable(f"worker serving the request ({type(error).__name__})") from None
        finally:
            self.num_in_flight -= 1
        # Decoded once the generation is in: a detokenizer error is our bug (a 500), not a worker's to retry.
        texts = TextStream(self.tokenizer, job.params.stop)
        for token_ids in chunks:
            texts.push(token_ids)
        texts.finish(result.finish_reason == "stop")
        self._observe(job, result, start_s)
        build = protocol.chat_response if is_chat else protocol.completion_response
        return build(job.request_id, self.config.model_id, texts.text, openai_finish_reason(result.finish_reason),
                     len(job.prompt_token_ids), len(result.output_token_ids), created_unix_s(start_s))

    async def _sse(self, req, is_chat: bool, job: GenerationJob, stream, first, result: GenerationResult,
                   start_s: float):
        texts = TextStream(self.tokenizer, job.params.stop)
        model_id, created_s = self.config.model_id, created_unix_s(start_s)
        include_usage = req.include_usage

        def chunk(delta: str | None, reason: str | None, role: str | None = None) -> bytes:
            if is_chat:
                return protocol.sse_event(protocol.chat_chunk(job.request_id, model_id, delta, reason, created_s,
                                                              role=role))
            return protocol.sse_event(protocol.completion_chunk(job.request_id, model_id, delta or "", reason,
                                                                created_s))

        try:
            if is_chat:
                yield chunk("", None, role="assistant")
            if first is not None:
                delta = texts.push(first)
                if delta:
                    yield chunk(delta, None)
            async for token_ids in stream:
                delta = texts.push(token_ids)
                if delta:
                    yield chunk(delta, None)
            tail = texts.finish(result.finish_reason == "stop")
            if tail:
                yield chunk(tail, None)
            yield chunk(None if is_chat else "", openai_finish_reason(result.finish_reason))
            if include_usage:
                usage = protocol.usage(len(job.prompt_token_ids), len(result.output_token_ids))
                builder = protocol.chat_usage_chunk if is_chat else protocol.completion_usage_chunk
                yield protocol.sse_event(builder(job.request_id, model_id, created_s, usage))
            yield protocol.SSE_DONE
            self._observe(job, result, start_s)
        except Exception as error:  # noqa: BLE001 - headers are sent: report in-band, OpenAI style
            # (a detokenizer error, our bug, reads the same here: the client already has part of the answer)
            logger.exception("stream of %s failed", job.request_id)
            self.metrics.observe_status("error")
            yield protocol.sse_event(APIError(503, f"generation failed ({type(error).__name__}); retry the request",
                                              "server_error").body())

    # -- routes --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._counted(self._generate(request, is_chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._counted(self._generate(request, is_chat=True))

    async def _counted(self, handling):
        """Count refused requests by status code (finished ones are counted where they finish)."""
        try:
            return await handling
        except APIError as error:
            self.metrics.observe_status(str(error.status_code))
            raise
        except asyncio.CancelledError:
            self.metrics.observe_status("cancelled")
            raise
        except Exception:
            self.metrics.observe_status("500")  # our bug: the app's handler answers it as internal_error
            raise

    async def _model_request(self, request: Request, model_cls):
        """A request body for the served model, its API key checked, parsed."""
        self._check_key(request)
        req = await self._parse(request, model_cls)
        if req.model not in self.config.accepted_model_ids:
            raise not_found_model(req.model)
        return req

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        req = await self._model_request(request, TokenizeRequest)
        return tokenize_answer(req, self.tokenizer, self.config.max_model_len)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        return detokenize_answer(await self._model_request(request, DetokenizeRequest), self.tokenizer)

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._check_key(request)
        return protocol.models_response([self.config.model_id], self.started_s, self.config.max_model_len)

    @app.get("/health")
    async def health(self):
        try:
            status = await asyncio.wait_for(self.controller.status.remote(), timeout=5.0)
        except Exception as error:  # noqa: BLE001 - unreachable controller is exactly what /health reports
            return JSONResponse({"status": "unavailable", "reason": f"controller: {type(error).__name__}"}, 503)
        num_ready = len(status.stats)
        body = {"status": "ok", "workers_ready": num_ready, "redis": status.is_redis_ok,
                "pending": status.num_pending,
                "kv_tokens": {s.worker_id: s.num_total_blocks * s.block_size for s in status.stats}}
        if not status.is_redis_ok or num_ready == 0:
            body["status"] = "unavailable"
            return JSONResponse(body, 503)
        return body

    @app.get("/metrics")
    async def metrics(self):
        try:
            status = await asyncio.wait_for(self.controller.status.remote(), timeout=5.0)
            self.metrics.set_cluster(cluster_snapshot(status))
        except Exception as error:  # noqa: BLE001 - serve the router's own metrics even when the controller is away
            logger.warning("metrics without cluster gauges: %s: %s", type(error).__name__, error)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/dashboard")
    async def dashboard(self):
        # Public: the page holds no data; it sends the key (URL fragment or prompt) to /dashboard/data.
        return HTMLResponse(DASHBOARD_HTML, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/data")
    async def dashboard_json(self, request: Request):
        self._check_key(request)
        try:
            status = await asyncio.wait_for(self.controller.status.remote(), timeout=5.0)
        except Exception as error:  # noqa: BLE001 - the page shows the outage instead of a 500
            raise unavailable(f"controller ({type(error).__name__})") from None
        tokens_per_s = self.throughput.update(time.monotonic(), generated_tokens_by_worker(status))
        numbers = RouterNumbers(self.config.model_id, self.config.policy, self.num_in_flight,
                                self.config.max_concurrent_requests, time.time() - self.started_s, tokens_per_s)
        return JSONResponse(dashboard_data(status, numbers), headers={"Cache-Control": "no-store"})


def build_router(config: ServiceConfig, redis_url: str, predictor_app=None):
    """The router bound to its predictor deployment (None: predictions in the router); `serve.run` it."""
    return Router.options(max_ongoing_requests=config.max_concurrent_requests + 64).bind(
        config.model_dump(), redis_url, predictor_app)
