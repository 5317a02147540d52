"""The whole service on a real local Ray cluster with real Redis and the real SmolLM2, over HTTP.

One service for the module (two workers, API keys on, fp32 so that an answer resumed on another worker has the
fault-free text: in bf16 a batch's shape can change a greedy token); the chaos tests run last because they kill
parts of it. Remote Redis, paused parts and a lost router replica: test_service_faults. Clients are the official
`openai` package and plain httpx.
"""

import asyncio
import importlib.metadata
import json
import os
import random
import signal
import threading
import time

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, ServiceConfig
from cluster.control.redis_server import connect
from fuzz_bodies import fuzz_body
from cluster.service import start_service, stop_service
from service_driver import assert_openai_error, controller_status, post, wait_idle
from workers.actors.ports import free_port
from workers.engine.models import load_tokenizer, resolve_model_dir

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_cache_dir):
    config = ServiceConfig(
        port=free_port(), num_workers=2, model_cache_dir=str(model_cache_dir), max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=64 * 1024**2, default_max_tokens=32, dtype="float32", api_keys=(API_KEY,),
        metrics_need_key=True, max_concurrent_requests=6,
        data_dir=str(tmp_path_factory.mktemp("s3serve-data")), num_cpus=8, num_torch_threads=1,
        stats_interval_s=0.25, max_body_bytes=64 * 1024)
    running = start_service(config, ready_timeout_s=600, progress=lambda _msg: None)
    yield running
    stop_service(running)


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


# -- the API -------------------------------------------------------------------------


def test_completion_fills_usage(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text
    assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streaming_matches_non_streaming_under_greedy(client):
    messages = [{"role": "user", "content": "List three fruits."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_completion_streaming_and_forced_length(client):
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True},
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 20
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_penalties_bias_and_stop_token_ids_reach_the_engine(client, service, model_cache_dir):
    prompt, tokens = "Count: one, two, three,", 12
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
    tokenizer = load_tokenizer(resolve_model_dir(MODEL, model_cache_dir))
    ids = tokenizer(plain.choices[0].text, add_special_tokens=False)["input_ids"]
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0,
                                        extra_body={"stop_token_ids": [ids[1]]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens <= 2
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0,
                                       logit_bias={str(ids[0]): -100}, frequency_penalty=1.5,
                                       extra_body={"ignore_eos": True, "top_k": 5, "repetition_penalty": 1.3})
    assert biased.choices[0].text != plain.choices[0].text and biased.usage.completion_tokens == tokens
    outside = post(service, "/v1/completions", json={"model": MODEL, "prompt": prompt, "logit_bias": {"999999": 1}})
    assert assert_openai_error(outside, 400)["param"] == "logit_bias"
    beam = post(service, "/v1/completions", json={"model": MODEL, "prompt": prompt, "use_beam_search": True})
    assert assert_openai_error(beam, 400)["param"] == "use_beam_search"  # refused, never silently dropped


def test_a_prompt_sent_as_token_ids_answers_as_its_text(service, client):
    text = "The capital of France is"
    ids = post(service, "/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    as_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
    for prompt in (ids, [ids]):
        as_ids = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert as_ids.choices[0].text == as_text.choices[0].text and as_ids.usage.prompt_tokens == len(ids)
    outside = post(service, "/v1/completions", json={"model": MODEL, "prompt": [1, 10**7]})
    assert assert_openai_error(outside, 400)["param"] == "prompt"


def test_tokenize_and_detokenize_round_trip_as_vllms(service):
    text = "The capital of France is"
    tokens = post(service, "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    assert post(service, "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json() == {"prompt": text}
    chat = post(service, "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": text}]}).json()
    usage = post(service, "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": text}]})
    assert chat["count"] == usage.json()["usage"]["prompt_tokens"]  # as the chat endpoint counts the prompt
    assert post(service, "/tokenize", json={"model": "gpt-9", "prompt": text}).status_code == 404


def test_models_and_health(client, service):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{service.base_url}/version").json() == {"version": importlib.metadata.version("s3serve")}
    assert httpx.get(f"{service.base_url}/v1/models",
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = httpx.get(f"{service.base_url}/health").json()
    assert health["status"] == "ok" and health["workers_ready"] == 2
    assert len(health["kv_tokens"]) == 2 and all(tokens >= MAX_MODEL_LEN for tokens in health["kv_tokens"].values())


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": ""}, 400, None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "word " * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, None),
    ({"model": MODEL, "prompt": "x" * (70 * 1024)}, 413, None),
])
def test_bad_input_is_a_shaped_4xx(service, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    error = assert_openai_error(post(service, "/v1/completions", **kwargs), status)
    if param is not None:
        assert error["param"] == param


def test_an_undeclared_field_is_answered_and_named_in_a_header(service):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "thinking": {"type": "enabled"},
            "messages": [{"role": "user", "content": "hi", "nick": "ann"}]}
    response = post(service, "/v1/chat/completions", json=body)
    assert response.status_code == 200 and "data: [DONE]" in response.text
    assert response.headers["x-s3-ignored-fields"] == "messages[].nick, thinking"
    plain = post(service, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert plain.status_code == 200 and "x-s3-ignored-fields" not in plain.headers


def test_prompt_logprobs_and_token_ids_as_vllm_gives_them(service):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 1, "return_token_ids": True}
    choice = post(service, "/v1/completions", json=body).json()["choices"][0]
    prompt_ids = choice["prompt_token_ids"]
    assert len(choice["token_ids"]) == 3 and len(choice["prompt_logprobs"]) == len(prompt_ids)
    assert choice["prompt_logprobs"][0] is None
    for token_id, entry in zip(prompt_ids[1:], choice["prompt_logprobs"][1:]):
        assert entry[str(token_id)]["logprob"] <= 0.0 and 1 <= len(entry) <= 2  # the prompt's token and the top one
        top = [item for item in entry.values() if item["rank"] == 1]
        assert len(top) == 1 and top[0]["logprob"] >= entry[str(token_id)]["logprob"]


def test_the_responses_api_through_the_official_client(client):
    kwargs = {"model": MODEL, "input": "Name a colour.", "instructions": "Answer in one word.",
              "max_output_tokens": 8, "temperature": 0.0, "store": False}
    whole = client.responses.create(**kwargs)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == whole.output_text  # greedy: the same answer


def test_a_tool_call_streams_its_arguments_to_the_official_clients_helper(client):
    city = {"type": "string", "maxLength": 12}  # short: the call ends well before max_tokens
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": city}, "required": ["city"]}}}]
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
              "tool_choice": {"type": "function", "function": {"name": "weather"}}, "max_tokens": 48,
              "temperature": 0.0}
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    with client.chat.completions.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0].message.tool_calls[0]
    fragments = [event for event in events if event.type == "tool_calls.function.arguments.delta"]
    done = [event for event in events if event.type == "tool_calls.function.arguments.done"]
    assert len(fragments) > 1 and len(done) == 1 and done[0].name == "weather"
    assert done[0].arguments == final.function.arguments == whole.function.arguments  # greedy: the same call
    assert "city" in json.loads(final.function.arguments)


def test_a_repeated_prompt_reports_its_cached_tokens(client):
    prompt = "Summarise the rules of chess for a beginner who has never played. " * 4
    usages = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2).usage for _ in range(3)]
    cached = [usage.prompt_tokens_details.cached_tokens for usage in usages]
    assert cached[0] == 0 and max(cached[1:]) > 0  # placed beside its cached prefix, it skips computing it
    assert all(n % 16 == 0 and n <= usages[0].prompt_tokens for n in cached)  # whole blocks of the prompt


def test_a_client_request_id_names_the_response_as_in_vllm(service):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    named = post(service, "/v1/completions", json=body, headers={"X-Request-Id": "trace-7"})
    assert named.json()["id"] == "cmpl-trace-7" and named.headers["x-request-id"] == "trace-7"  # echoed by Serve
    body["request_id"] = "from-body"
    assert post(service, "/v1/completions", json=body, headers={"X-Request-Id": "t"}).json()["id"] == "cmpl-from-body"
    again = post(service, "/v1/completions", json=body)  # the same id twice is served: the jobs keep their own
    assert again.status_code == 200 and again.json()["id"] == "cmpl-from-body"


def _engine_counts(service) -> tuple[int, int]:
    """Prompt tokens admitted and tokens generated so far, over every worker, once their stats have caught up."""
    time.sleep(0.6)  # two stats intervals
    wait_idle(service)
    stats = controller_status(service).stats
    return sum(s.num_prompt_tokens for s in stats), sum(s.num_generated_tokens for s in stats)


def _replayed(service) -> float:
    """s3_requests_total{status="replayed"} as /metrics gives it (0 before the first)."""
    text = httpx.get(f"{service.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "s3_requests_total" and sample.labels.get("status") == "replayed")


def test_a_request_sent_again_with_its_idempotency_key_gets_its_answer_without_a_second_generation(service):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 1.0}  # sampled: a second generation would most likely differ
    headers = {"Idempotency-Key": f"retry-{random.getrandbits(64):x}"}
    first = post(service, "/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    before, replayed = _engine_counts(service), _replayed(service)
    again = post(service, "/v1/chat/completions", json=body, headers=headers)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json()
    assert _engine_counts(service) == before  # nothing admitted, nothing generated
    assert _replayed(service) == replayed + 1  # counted as replayed, not as a second "ok"
    reused = post(service, "/v1/chat/completions", json={**body, "max_tokens": 9}, headers=headers)
    assert assert_openai_error(reused, 422)["code"] == "idempotency_key_reused"
    other = post(service, "/v1/responses", json={"model": MODEL, "input": "Name a colour.", "max_output_tokens": 8},
                 headers=headers)  # another endpoint is another request
    assert assert_openai_error(other, 422)["code"] == "idempotency_key_reused"
    responses = {"model": MODEL, "input": "Name a colour.", "max_output_tokens": 8, "temperature": 1.0}
    headers = {"Idempotency-Key": f"retry-{random.getrandbits(64):x}"}
    first = post(service, "/v1/responses", json=responses, headers=headers)
    again = post(service, "/v1/responses", json=responses, headers=headers)
    assert first.status_code == again.status_code == 200 and again.json() == first.json()
    assert post(service, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                headers={"Idempotency-Key": "has space"}).status_code == 400


def test_chat_with_no_messages_or_too_long_messages_is_a_400(service):
    assert_openai_error(post(service, "/v1/chat/completions", json={"model": MODEL, "messages": []}), 400)
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 10)}]}
    error = assert_openai_error(post(service, "/v1/chat/completions", json=long_chat), 400)
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"


def test_fuzzed_bodies_get_openai_shaped_4xx_and_never_a_5xx(service):
    """Seeded: 100 bodies to each completion endpoint; every error is OpenAI-shaped and none is a 5xx."""
    rng = random.Random(20261122)
    counts: dict[int, int] = {}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}",
                                            "Content-Type": "application/json"}) as http:
        for path, is_chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
            for _ in range(100):
                content = fuzz_body(rng, is_chat, MODEL)
                response = http.post(f"{service.base_url}{path}", content=content)
                counts[response.status_code] = counts.get(response.status_code, 0) + 1
                assert response.status_code < 500, (path, content[:300], response.text)
                if response.status_code >= 400:
                    assert_openai_error(response, response.status_code)
                elif b'"stream": true' not in content and b'"stream":true' not in content:
                    assert response.json()["choices"], (content[:300], response.text)
    assert counts.get(400, 0) >= 100 and sum(counts.values()) == 200, counts  # mostly refused, all answered
    assert httpx.get(f"{service.base_url}/health").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_missing_or_wrong_key_is_a_401(service, headers):
    response = httpx.post(f"{service.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                          headers=headers)
    assert_openai_error(response, 401)


def test_still_healthy_after_bad_input(client):
    assert client.completions.create(model=MODEL, prompt="2 + 2 =", max_tokens=4, temperature=0).choices


def test_metrics_are_prometheus_text(service, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert httpx.get(f"{service.base_url}/metrics").status_code == 401  # metrics_need_key
    text = httpx.get(f"{service.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"s3_ttft_seconds", "s3_request_latency_seconds", "s3_kv_blocks_total", "s3_queue_depth"} <= set(families)
    workers = {s.labels["worker"] for s in families["s3_kv_blocks_total"].samples}
    assert len(workers) >= 2
    vllm = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
            "vllm:generation_tokens", "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
            "vllm:request_success", "vllm:inter_token_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
            # what vLLM's example Grafana dashboard reads besides (tests/ingress/test_grafana_dashboard.py: panel by panel)
            "vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds", "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
            "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"}
    assert vllm <= set(families)  # what a vLLM user's dashboards read, labelled with the served model's name
    assert all(sample.labels["model_name"] == MODEL for name in vllm for sample in families[name].samples)


def test_finished_requests_feed_the_retraining_stream(service, client):
    import redis

    from cluster.config import RETRAINER_NAME
    from predictor_service.sample_stream import SampleStream

    stream = SampleStream(redis.Redis.from_url(service.redis_url, decode_responses=True))
    before = stream.length()
    client.completions.create(model=MODEL, prompt="Count to five:", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while stream.length() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    _, sample = stream.read()[-1]
    assert sample.prompt_text == "Count to five:" and sample.true_output_tokens == 5
    assert sample.predicted_upper_bound_tokens is not None
    # A chat's messages reach the predictor (and the stream) joined as the training labels join them
    before = stream.length()
    client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}])
    deadline = time.monotonic() + 10
    while stream.length() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stream.read()[-1][1].prompt_text == "Be brief.\n\nName a colour."
    assert ray.get_actor(RETRAINER_NAME, namespace=RAY_NAMESPACE)  # the retraining task runs beside the service


def test_overload_gets_429_with_retry_after(service):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            body = {"model": MODEL, "prompt": "Count:", "max_tokens": 48, "ignore_eos": True}
            return await asyncio.gather(*(http.post(f"{service.base_url}/v1/completions", json=body)
                                          for _ in range(14)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes, codes
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1
            assert_openai_error(r, 429)


def test_client_disconnect_cancels_and_frees_blocks(service):
    num_cancelled = controller_status(service).counters.get("finished_cancelled", 0)
    with httpx.stream("POST", f"{service.base_url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break  # leave after the first event
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status = controller_status(service)
        if all(s.num_running == 0 and s.num_waiting == 0 for s in status.stats) \
                and not any(status.reserved_blocks.values()):
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the abandoned request still holds resources: {status}")
    # released by the router as cancelled, not dropped later by the ledger's reconcile
    assert status.counters.get("finished_cancelled", 0) == num_cancelled + 1, status.counters


# -- chaos (last: they kill parts of the service) ------------------------------------------


def test_worker_killed_mid_stream_still_completes(service, client):
    n = 96
    request = {"model": MODEL, "prompt": "Write a poem about the sea.", "max_tokens": n, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    reference = client.completions.create(**request).choices[0].text  # the same request without a fault
    received: list[str] = []
    errors: list[BaseException] = []

    def consume():
        try:
            stream = client.completions.create(**request, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices:
                    received.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    received.append(("usage", chunk.usage.completion_tokens))
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    thread = threading.Thread(target=consume)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while len(received) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(received) >= 5, f"the stream did not start: {errors}"
        # where the controller placed it (its ledger, current); the polled worker stats may lag a tick
        busy = [worker_id for worker_id, blocks in controller_status(service).reserved_blocks.items() if blocks > 0]
        assert len(busy) == 1, f"the one request should be placed on one worker: {busy}"
        ray.kill(ray.get_actor(f"s3serve-worker-{busy[0]}", namespace=RAY_NAMESPACE), no_restart=True)
    finally:
        thread.join(timeout=300)  # a failure above must not leave this stream running into the next test
    assert not errors, errors
    assert received[-1] == ("usage", n)  # every token arrived, none twice
    assert "".join(received[:-1]) == reference  # and the stream resumed elsewhere with the right text
    deadline = time.monotonic() + 300  # the controller replaces the dead worker
    while time.monotonic() < deadline:
        status = controller_status(service)
        if len(status.stats) == 2 and busy[0] not in {s.worker_id for s in status.stats}:
            break
        time.sleep(1.0)
    assert status.counters.get("requeues", 0) >= 1


def test_redis_killed_under_load_is_restarted_and_nothing_is_lost_or_counted_twice(service, client):
    n = 48
    results: list = []
    requests = [{"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": n, "temperature": 0,
                 "extra_body": {"ignore_eos": True}} for i in range(4)]
    references = [client.completions.create(**request).choices[0].text for request in requests]  # no fault

    def consume(i: int) -> None:
        try:
            chunks = list(client.completions.create(**requests[i], stream=True,
                                                    stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            results.append([c.usage.completion_tokens for c in chunks if c.usage is not None] + [text == references[i]])
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            results.append(error)

    wait_idle(service)  # nothing from an earlier test finishes (and is counted) during this one
    redis_client = connect(service.redis_url)
    before = int(redis_client.hget("s3:ctl:counters", "finished_length") or 0)
    restarts = service.redis.num_restarts
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not any(s.num_running for s in controller_status(service).stats) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(service.redis.pid, signal.SIGKILL)
    killed_s = time.monotonic()
    for thread in threads:
        thread.join(timeout=300)
    assert results == [[n, True]] * 4  # every stream completed whole, with the fault-free text
    while httpx.get(f"{service.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() - killed_s < 15, "not healthy again within 15 s"
        time.sleep(0.2)
    assert service.redis.num_restarts == restarts + 1
    out = client.completions.create(model=MODEL, prompt="After the crash,", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 6
    deadline = time.monotonic() + 30  # releases queued during the outage reach Redis once, counted once
    while int(redis_client.hget("s3:ctl:counters", "finished_length") or 0) < before + 5 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    assert int(redis_client.hget("s3:ctl:counters", "finished_length")) == before + 5
    assert redis_client.scard("s3:ctl:requests:state:placed") == 0


def test_redis_down_is_a_503_and_a_restart_recovers(service, client):
    before = controller_status(service).counters
    service.redis.stop()
    try:
        assert httpx.get(f"{service.base_url}/health", timeout=30).status_code == 503
        response = post(service, "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert_openai_error(response, 503)
    finally:
        service.redis.start()
    out = client.completions.create(model=MODEL, prompt="After the restart,", max_tokens=6, temperature=0)
    assert out.choices[0].text
    after = controller_status(service)
    assert after.is_redis_ok
    assert after.counters.get("worker_ids") == before.get("worker_ids")  # persisted state survived


def test_controller_killed_is_restarted_with_its_state(service, client):
    before = controller_status(service)
    ray.kill(ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE), no_restart=False)
    out = client.completions.create(model=MODEL, prompt="Again:", max_tokens=6, temperature=0)
    assert out.choices[0].text
    after = controller_status(service)
    assert {w.worker_id for w in after.workers if w.state == "ready"} == \
        {w.worker_id for w in before.workers if w.state == "ready"}  # found its workers, started none
    assert after.counters.get("requeues", 0) == before.counters.get("requeues", 0)

