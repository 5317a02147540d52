"""The router: Ray Serve ingress with an OpenAI-compatible HTTP API.

Checks API keys and parses bodies; the generation endpoints then go to `completions.py` (chat
template, length prediction, placement through the controller, the answer as SSE or one JSON
body). Also tokenize, models, health, metrics and the dashboard. Bad input is a 4xx with
OpenAI's error shape, never a 500.

The FastAPI app is module-level because `serve.ingress` binds routes to a class at
import time; every replica builds its own state in `Router.__init__`.
"""

import asyncio
import json
import logging
import re
import time
from importlib.metadata import version as package_version

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from ray import serve

from cluster.config import ServiceConfig, worker_actor_name
from cluster.control.controller import get_or_create_controller
from cluster.control.redis_server import connect_async
from cluster.ingress import openai_protocol as protocol
from cluster.ingress.completions import Completions
from cluster.ingress.cors import install_cors
from cluster.ingress.dashboard import (DASHBOARD_HTML, RouterNumbers, ThroughputMeter, dashboard_data,
                                       generated_tokens_by_worker)
from cluster.ingress.errors import (APIError, bad_request, body_too_large, check_api_key, install_error_handlers,
                                    not_found_model, unavailable, validation_error)
from cluster.ingress.event_stream import EventStream
from cluster.ingress.generation import GenerationJob, GenerationResult, WorkerHandles, run_job
from cluster.ingress.idempotency import (IDEMPOTENCY_HEADER, REPLAYED_HEADER, IdempotentAnswers, fingerprint,
                                        scoped_key)
from cluster.ingress.metrics import ServiceMetrics, cluster_snapshot
from cluster.ingress.predictor_client import DeploymentPredictor, InRouterPredictor
from cluster.ingress.responses_api import ResponsesRequest, chat_body, response_events, response_from_chat
from cluster.ingress.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize_answer, tokenize_answer
from cluster.ingress.unknown_fields import IGNORED_FIELDS_HEADER, UnknownFieldLog, header_value, unknown_fields
from workers.engine.models import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
from workers.scheduling.policies import length_range_tokens, make_rule
from workers.scheduling.prefix_cache import prefix_cache_salt, salt_hash
from workers.values.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


app = FastAPI(title="S3 Serve", docs_url=None, redoc_url=None)
install_error_handlers(app)
install_cors(app)  # off until the router sets app.state.allowed_origins


# Generations outlive Serve's 20 s default drain: a rollout lets the old replica finish its streams.
ROUTER_DRAIN_TIMEOUT_S = 600.0
# Serve finds a dead replica at its next health check (every 10 s by default); a killed router replica is then
# replaced 9-11 s after the kill instead of 15 (`bench chaos`'s kill_router, measured here).
ROUTER_HEALTH_CHECK_PERIOD_S = 2.0


# Module-level helpers the Router calls are defined above it: Serve pickles the class when it is decorated.
def client_request_id(header: str | None, body_field: str | None) -> str | None:
    """The id a client gives its request: vLLM's `request_id` field, else an X-Request-Id header (vLLM reads the
    header first; Ray Serve gives every request one, its own where the client sent none, and echoes it in the
    response's x-request-id)."""
    if body_field is not None:
        return body_field
    if header is None:
        return None
    if not re.fullmatch(r"[\x21-\x7e]{1,256}", header):
        raise bad_request("the X-Request-Id header must be 1 to 256 visible ASCII characters", param="X-Request-Id")
    return header


@serve.deployment(name="router", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000,
                  graceful_shutdown_timeout_s=ROUTER_DRAIN_TIMEOUT_S,
                  health_check_period_s=ROUTER_HEALTH_CHECK_PERIOD_S)
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
        self.policy = make_rule(self.config.policy)  # which predicted length the workers plan by
        # First, so that the workers load their model while this replica loads the predictor and the tokenizer.
        self.controller = get_or_create_controller(self.config, redis_url)
        # A running controller keeps the config it was created with; a rollout brings the new one.
        self.controller.reconfigure.remote(self.config.model_dump())
        self.predictor = (DeploymentPredictor(predictor) if predictor is not None else
                          InRouterPredictor(self.config.predictor_root, self.config.quantile,
                                            length_range_tokens(self.config.max_model_len), self.config.model))
        model_dir = resolve_model_dir(self.config.model, self.config.model_cache_dir, self.config.revision)
        self.tokenizer = load_tokenizer(resolve_tokenizer_dir(self.config.tokenizer, model_dir,
                                                              self.config.model_cache_dir),
                                        self.config.chat_template)
        # Workers name cached blocks with the same salt, so these hashes match what they report.
        self._prefix_root = salt_hash(prefix_cache_salt(self.config.model, self.config.dtype))
        self.workers = WorkerHandles()
        self.metrics = ServiceMetrics(model_name=self.config.model_id)
        app.state.allowed_origins = self.config.allowed_origins
        self.api_keys = frozenset(self.config.api_keys)
        self.completions = Completions(self.config, self.tokenizer, self.metrics, self._predict, self._start_job,
                                       self._prefix_root)
        self.started_s = int(time.time())
        self.throughput = ThroughputMeter()
        self.unknown_field_log = UnknownFieldLog()
        self.idempotent = IdempotentAnswers(connect_async(redis_url), self.config.idempotency_window_s)

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
            req = model_cls.model_validate(payload)
        except ValidationError as error:
            raise validation_error(list(error.errors())) from None
        return req, unknown_fields(payload, model_cls)

    def _check_unknown(self, names: list[str]) -> None:
        """Refuse undeclared fields under strict_request_fields; otherwise log each name the first time."""
        if names and self.config.strict_request_fields:
            raise bad_request(f"unknown field(s) {header_value(names)}: this server refuses fields it does not "
                              "declare (strict_request_fields); leave them out",
                              param=header_value(names[:1]) or None)
        for name in self.unknown_field_log.first_seen(names):
            logger.warning("request field %r is not declared here and is ignored (each response that carries it names "
                           "it in %s; strict_request_fields makes it a 400)", name, IGNORED_FIELDS_HEADER)

    def _start_job(self, job: GenerationJob, result: GenerationResult):
        return run_job(job, self.controller, self.workers, result, worker_actor_name)

    async def _predict(self, request_id: str, text: str, num_prompt_tokens: int, params: SamplingParams):
        payload = {"prompt_id": request_id, "prompt_text": text, "num_prompt_tokens": num_prompt_tokens,
                   "max_tokens": params.max_tokens, "temperature": params.temperature}
        prediction = await self.predictor.predict(payload)
        point = prediction["point_tokens"]
        return self.policy.prediction_from(point, prediction["upper_bound_tokens"]), point

    # -- routes --------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._counted(self._generate(request, is_chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._counted(self._generate(request, is_chat=True))

    async def _generate(self, request: Request, is_chat: bool):
        model_cls = protocol.ChatCompletionRequest if is_chat else protocol.CompletionRequest
        self._check_key(request)
        req, unknown = await self._parse(request, model_cls)
        self._check_unknown(unknown)
        self._check_model(req)
        request_id = client_request_id(request.headers.get("x-request-id"), req.request_id)
        return await self._once(request, req, unknown, lambda: self.completions.answer(req, is_chat, request_id,
                                                                                        tuple(unknown)))

    @app.post("/v1/responses")
    async def responses(self, request: Request):
        return await self._counted(self._respond(request))

    async def _respond(self, request: Request):
        """OpenAI's Responses API, answered through the chat endpoint (`cluster.ingress.responses_api`)."""
        self._check_key(request)
        req, unknown = await self._parse(request, ResponsesRequest)
        self._check_unknown(unknown)
        self._check_model(req)
        try:
            chat_req = protocol.ChatCompletionRequest.model_validate(chat_body(req))
        except ValidationError as error:
            raise validation_error(list(error.errors())) from None
        except ValueError as error:
            raise bad_request(str(error), "input") from None
        ignored = (*unknown, *(["include"] if req.include else []))  # nothing stored, so nothing to include

        async def produce():
            chat = await self.completions.answer(chat_req, True, client_request_id(
                request.headers.get("x-request-id"), None), ignored)
            headers = {key: value for key, value in chat.headers.items() if key.startswith("x-")}
            if req.stream:
                return EventStream(response_events(req, chat.body_iterator), headers=headers, on_close=chat.on_close)
            return JSONResponse(response_from_chat(req, json.loads(chat.body)), headers=headers)

        return await self._once(request, req, unknown, produce)

    async def _once(self, request: Request, req, unknown: list[str], produce):
        """`produce()`'s response; with an Idempotency-Key, the first answer to that key (`cluster.ingress.idempotency`:
        a retry waits for it or gets it kept, and never generates a second one)."""
        key = request.headers.get(IDEMPOTENCY_HEADER)
        if key is None:
            return await produce()
        response, kept = await self.idempotent.answer(scoped_key(request.headers.get("authorization"), key),
                                                      fingerprint(request.url.path, req.model_dump(mode="json"),
                                                                  unknown),
                                                      bool(req.stream), produce)
        if kept is None:
            return response
        self.metrics.observe_status("replayed")
        return Response(kept.body, status_code=kept.status, media_type="application/json",
                        headers={**kept.headers, REPLAYED_HEADER: "true"})

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
        """A request body for the served model, its API key checked, parsed (its model declares every field)."""
        self._check_key(request)
        req, _ = await self._parse(request, model_cls)
        self._check_model(req)
        return req

    def _check_model(self, req) -> None:
        if req.model not in self.config.accepted_model_ids:
            raise not_found_model(req.model)

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

    @app.get("/version")
    async def version(self):
        """The server's version, as vLLM's /version answers it (public, like /health)."""
        return {"version": package_version("s3serve")}

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
    async def metrics(self, request: Request):
        if self.config.metrics_need_key:
            self._check_key(request)
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
        numbers = RouterNumbers(self.config.model_id, self.config.policy, self.completions.num_in_flight,
                                self.config.max_concurrent_requests, time.time() - self.started_s, tokens_per_s)
        return JSONResponse(dashboard_data(status, numbers), headers={"Cache-Control": "no-store"})


def build_router(config: ServiceConfig, redis_url: str, predictor_app=None):
    """The router bound to its predictor deployment (None: predictions in the router); `serve.run` it."""
    return Router.options(max_ongoing_requests=config.max_concurrent_requests + 64).bind(
        config.model_dump(), redis_url, predictor_app)
