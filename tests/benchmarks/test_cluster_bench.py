"""`bench cluster`: its pure parts without Ray, the load generator against a small real HTTP server,
and one real run of the bench (slow).
"""

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from benchmarks import cluster_bench, http_load
from benchmarks.cluster_bench import summarize_cluster, summarize_results
from benchmarks.cluster_bench_config import ClusterBenchConfig
from benchmarks.cluster_ratios import ratios_against, ratios_of, routing_ratios
from benchmarks.cluster_plan import build_load_requests
from benchmarks.http_load import LoadPlan, LoadRequest, RequestResult, read_plan, write_plan
from benchmarks.report import percentile
from benchmarks.traces import build_requests, load_prompt_texts, read_trace


def make_result(request_id: str, sent_s: float = 0.0, first_s: float | None = 0.5, finished_s: float = 2.0,
                tokens: int | None = 10, is_ok: bool = True, overhead_ms: float | None = 3.0) -> RequestResult:
    return RequestResult(request_id, is_ok, 200 if is_ok else 429, None if is_ok else "queue full", sent_s,
                         first_s if is_ok else None, finished_s, tokens if is_ok else None, 5 if is_ok else None,
                         overhead_ms)


def make_plan(forced: dict[str, int]) -> list[LoadRequest]:
    return [LoadRequest(rid, 0.0, "some text", 5, 100, n) for rid, n in forced.items()]


# -- pure parts ----------------------------------------------------------------------------


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0  # round(0.5 * 99) = 50 -> the 51st value
    assert percentile(values, 0.99) == 99.0
    assert percentile(list(reversed(values)), 0.0) == 1.0
    assert percentile([7.0], 0.99) == 7.0
    assert percentile([], 0.5) is None


def test_summarize_results_counts_throughput_over_first_send_to_last_finish():
    plan = make_plan({"a": 10, "b": 10, "c": 30})
    results = [make_result("a", sent_s=1.0, first_s=1.5, finished_s=3.0),
               make_result("b", sent_s=2.0, first_s=2.2, finished_s=5.0, overhead_ms=9.0),
               make_result("c", sent_s=2.5, is_ok=False, finished_s=2.6)]
    summary = summarize_results(results, plan)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["wall_s"] == pytest.approx(4.0)  # 1.0 -> 5.0
    assert summary["tokens_per_s"] == pytest.approx(20 / 4.0)
    assert summary["requests_per_s"] == pytest.approx(2 / 4.0)
    assert summary["ttft_p50_s"] == pytest.approx(0.2) and summary["ttft_p99_s"] == pytest.approx(0.5)
    assert summary["latency_p99_s"] == pytest.approx(3.0)
    assert summary["overhead_p50_ms"] == 3.0 and summary["overhead_p99_ms"] == 9.0
    assert summary["all_outputs_exact_length"] is False  # one failed
    assert summary["errors"] == ["429: queue full"]


def test_summarize_results_checks_every_forced_length():
    plan = make_plan({"a": 10, "b": 12})
    exact = summarize_results([make_result("a", tokens=10), make_result("b", tokens=12)], plan)
    short = summarize_results([make_result("a", tokens=10), make_result("b", tokens=11)], plan)
    assert exact["all_outputs_exact_length"] is True and short["all_outputs_exact_length"] is False
    empty = summarize_results([], [])
    assert empty["tokens_per_s"] is None and empty["ttft_p50_s"] is None


def test_natural_runs_report_answers_at_the_limit_and_prompts_the_service_counted_differently():
    plan = [LoadRequest("a", 0.0, "t", 5, 100, None), LoadRequest("b", 0.0, "t", 6, 40, None)]
    summary = summarize_results([make_result("a", tokens=17), make_result("b", tokens=40)], plan)
    assert summary["all_outputs_exact_length"] is None  # nothing was forced
    assert summary["hit_length_limit"] == 1  # b stopped at its max_tokens
    assert summary["prompt_tokens_differ"] == 1  # the service counted 5 prompt tokens for b, the plan 6


def test_summarize_cluster_balance_and_counters():
    summary = summarize_cluster({"w1": 300, "w2": 100}, {"migrations": 2, "overruns": 5, "worker_ids": 2})
    assert summary["worker_balance_min_max"] == pytest.approx(1 / 3)
    assert (summary["migrations"], summary["overruns"], summary["requeues"], summary["preemptions"]) == (2, 5, 0, 0)
    assert summarize_cluster({}, {})["worker_balance_min_max"] is None
    assert summarize_cluster({}, {})["prefix_hit_rate"] is None
    assert summarize_cluster({"w1": 1}, {}, (400, 300))["prefix_hit_rate"] == 0.75
    assert summarize_cluster({"w1": 0, "w2": 0}, {})["worker_balance_min_max"] is None


def test_ratios_compare_s3_with_each_baseline_that_ran():
    summaries = {"s3": {"tokens_per_s": 30.0}, "max_reserve": {"tokens_per_s": 10.0},
                 "paged_greedy": {"tokens_per_s": None}}
    assert ratios_of(summaries) == {"s3_vs_max_reserve_tokens_per_s": 3.0, "s3_vs_paged_greedy_tokens_per_s": None}
    assert ratios_of({"max_reserve": {"tokens_per_s": 10.0}}) == {}
    probed = ratios_of({"s3_peak+probe": {"tokens_per_s": 12.0}, "sglang_ratio": {"tokens_per_s": 10.0}})
    assert probed == {"s3_peak+probe_vs_sglang_ratio_tokens_per_s": 1.2}


def run(tokens_per_s, mean, p99, ttft):
    """A run's summary as the ratios read it."""
    return {"tokens_per_s": tokens_per_s, "latency_mean_s": mean, "latency_p99_s": p99, "ttft_p50_s": ttft}


def test_routing_runs_are_compared_with_the_same_policys_room_run():
    summaries = {"s3_peak@room": run(100.0, 10.0, 20.0, 0.5), "s3_peak@predicted_work": run(110.0, 9.0, 16.0, 0.25),
                 "paged_greedy@predicted_work": run(90.0, 9.0, 18.0, 0.5)}  # no room run to compare with
    assert routing_ratios(summaries) == {"s3_peak@predicted_work": {"tokens_per_s": 1.1, "latency_mean_s": 0.9,
                                                                     "latency_p99_s": 0.8, "ttft_p50_s": 0.5}}
    assert routing_ratios({"s3_peak": run(1.0, 1.0, 1.0, 1.0)}) == {}


def test_load_requests_are_real_text_whose_length_the_router_will_count(shared_data, smollm2_tokenizer):
    rows = read_trace(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv", 12)
    requests, _ = build_requests(rows, smollm2_tokenizer, load_prompt_texts(shared_data / "prompts" / "pool.jsonl"),
                                 max_len=256, max_prompt_tokens=64, mode="online", time_scale=0.5)
    plan, _ = build_load_requests(requests, smollm2_tokenizer, max_len=256)
    assert [p.request_id for p in plan] == [r.request_id for r in requests]
    for load, replay in zip(plan, requests):
        assert load.arrival_s == replay.arrival_s
        assert load.num_prompt_tokens == len(smollm2_tokenizer.encode(load.prompt, add_special_tokens=False))
        assert abs(load.num_prompt_tokens - len(replay.prompt_token_ids)) <= 4
        assert load.max_tokens == 256 - load.num_prompt_tokens  # what a client leaves itself: the context
        assert load.forced_output_tokens == min(replay.output_tokens, load.max_tokens)
    assert plan[1].arrival_s == pytest.approx(rows[1].arrival_s * 0.5)


def test_plan_file_round_trips_and_a_bad_one_is_a_clear_error(tmp_path):
    natural = LoadRequest("c", 0.5, "Hi", 3, 60, None, messages=({"role": "user", "content": "Hi"},))
    plan = LoadPlan("http://127.0.0.1:1", "m", 3, (*make_plan({"a": 4, "b": 6}), natural), endpoint="chat")
    write_plan(tmp_path / "plan.json", plan)
    assert read_plan(tmp_path / "plan.json") == plan
    (tmp_path / "bad.json").write_text('{"base_url": "x"}')
    with pytest.raises(ValueError, match="bad.json is not a load plan"):
        read_plan(tmp_path / "bad.json")


@pytest.mark.parametrize("overrides, message", [
    ({"policies": ("s3", "fifo")}, "choose one or more"),
    ({"policies": ("s3", "s3")}, "twice"),
    ({"num_requests": 0}, "--num-requests"),
    ({"time_scale": -1.0}, "--time-scale"),
    ({"max_len": 128, "max_prompt_tokens": 128}, "--max-prompt-tokens"),
    ({"policies": ("s3_peak+probe",)}, r"s3_peak\+probe with --workload natural"),
    ({"workload": "natural", "policies": ("paged_greedy",)}, "noisy oracle needs forced lengths"),
    ({"workload": "natural", "predictor": "default", "policies": ("s3+probe",), "probe": "/nonexistent"},
     "not a probe folder"),
    ({"workload": "replay"}, "--workload 'replay'"),
    ({"rebalance_min_gap": 1}, "--rebalance-min-gap must be 0 .off. or at least 2"),
    ({"dtype": "int8"}, "--dtype 'int8'"),
    ({"routings": ("room", "random")}, "routing must be one of predicted_work, room, least_requests"),
])
def test_config_check_names_the_bad_option(overrides, message, shared_data):
    config = ClusterBenchConfig(trace_path=shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv",
                                prompts_path=shared_data / "prompts" / "pool.jsonl", **overrides)
    with pytest.raises(ValueError, match=message):
        config.check()


def test_missing_trace_is_a_one_line_error(tmp_path, capsys):
    from s3serve_cli.main import main

    assert main(["bench", "cluster", "--trace", str(tmp_path / "none.csv"), "--quick"]) == 2
    err = capsys.readouterr().err
    assert f"--trace {tmp_path / 'none.csv'} does not exist" in err.splitlines()[0]


# -- the load generator against a small real HTTP server ----------------------------------


def _sse_app(seen: list[dict]) -> Starlette:
    """Answers like the router: a 429 for prompt "full", else streamed chunks and a usage chunk."""

    async def completions(request):
        body = await request.json()
        seen.append({"body": body, "at_s": time.monotonic()})
        if body["prompt"] == "full":
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429)
        if not body.get("stream"):
            usage = {"prompt_tokens": 2, "completion_tokens": body["forced_output_tokens"]}
            return JSONResponse({"choices": [{"text": "one two", "finish_reason": "length"}], "usage": usage})

        async def events():
            for piece in ["one", " two"] + [""] * (body["forced_output_tokens"] - 2):
                await asyncio.sleep(0.01)
                yield f"data: {json.dumps({'choices': [{'text': piece, 'finish_reason': None}]})}\n\n"
            usage = {"prompt_tokens": 2, "completion_tokens": body["forced_output_tokens"]}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-s3-overhead-ms": "1.250"})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture()
def sse_server():
    seen: list[dict] = []
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_sse_app(seen), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", seen
    server.should_exit = True
    thread.join(timeout=10)


def test_drive_sends_at_arrival_times_streams_and_records_failures(sse_server):
    base_url, seen = sse_server
    requests = (LoadRequest("a", 0.0, "hello", 1, 50, 4), LoadRequest("b", 0.3, "hello again", 2, 50, 3),
                LoadRequest("c", 0.0, "full", 1, 50, 2))
    results = asyncio.run(http_load.drive(LoadPlan(base_url, "m", 2, requests)))
    by_id = {r.request_id: r for r in results}
    assert by_id["a"].is_ok and by_id["a"].num_completion_tokens == 4 and by_id["a"].overhead_ms == 1.25
    assert by_id["a"].sent_s < by_id["a"].first_token_s < by_id["a"].finished_s
    assert by_id["b"].sent_s >= 0.3 and by_id["b"].num_completion_tokens == 3
    assert not by_id["c"].is_ok and by_id["c"].status_code == 429 and "queue full" in by_id["c"].error
    body = next(s["body"] for s in seen if s["body"]["prompt"] == "hello")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["forced_output_tokens"], body["ignore_eos"]) == (50, 4, True)
    # the streamed text "one two" is fingerprinted; "b" streamed the same text, so the same digest
    assert by_id["a"].output_digest == http_load.text_digest("one two") == by_id["b"].output_digest
    assert by_id["c"].output_digest is None


def test_whole_answers_and_client_hang_ups_are_told_apart(sse_server):
    base_url, seen = sse_server
    requests = (LoadRequest("whole", 0.0, "hello", 1, 50, 4, stream=False),
                LoadRequest("streamed", 0.0, "hello", 1, 50, 4),
                LoadRequest("hung_up", 0.0, "hello", 1, 50, 4, cancel_after_events=1))
    by_id = {r.request_id: r for r in asyncio.run(http_load.drive(LoadPlan(base_url, "m", 3, requests)))}
    whole = by_id["whole"]
    assert whole.is_ok and whole.num_completion_tokens == 4 and whole.saw_done
    assert whole.output_digest == by_id["streamed"].output_digest  # the same text, however it came
    assert sum("stream" not in s["body"] for s in seen) == 1  # only the whole one asked for one body
    hung_up = by_id["hung_up"]
    assert hung_up.error == http_load.CANCELLED and hung_up.num_text_events == 1 and not hung_up.saw_done


def test_a_natural_request_is_not_forced_and_chat_messages_go_as_they_are():
    plan = LoadPlan("http://x", "m", 1, (), endpoint="chat")
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    body = http_load.request_body(plan, LoadRequest("a", 0.0, "Be brief.\n\nHi", 9, 50, None, messages=messages))
    assert "forced_output_tokens" not in body and "ignore_eos" not in body and body["temperature"] == 0.0
    assert body["messages"] == list(messages) and body["max_tokens"] == 50
    plain = http_load.request_body(plan, LoadRequest("b", 0.0, "Hi", 1, 50, 7))
    assert plain["messages"] == [{"role": "user", "content": "Hi"}] and plain["forced_output_tokens"] == 7


def test_load_generator_runs_as_its_own_process(sse_server, tmp_path):
    import subprocess
    import sys

    base_url, _ = sse_server
    write_plan(tmp_path / "plan.json", LoadPlan(base_url, "m", 4, (LoadRequest("a", 0.0, "hi", 1, 9, 5),)))
    done = subprocess.run([sys.executable, "-m", "benchmarks.http_load", "--plan", str(tmp_path / "plan.json"),
                           "--out", str(tmp_path / "out.json")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [result] = http_load.read_results(tmp_path / "out.json")
    assert result.is_ok and result.num_completion_tokens == 5


# -- the real thing ---------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_runs_the_service_and_every_request_gets_its_forced_length(shared_data, model_cache_dir, tmp_path):
    config = ClusterBenchConfig(
        trace_path=shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv",
        prompts_path=shared_data / "prompts" / "pool.jsonl", policies=("s3",), num_workers=2, num_requests=4,
        time_scale=0.0, max_len=256, max_prompt_tokens=24, concurrency=4)
    result = cluster_bench.run(config, model_cache_dir=model_cache_dir, json_path=tmp_path / "cluster.json")
    written = json.loads(Path(tmp_path / "cluster.json").read_text())
    assert written["policies"].keys() == {"s3"} and set(written) >= {"ratios", "environment", "capping"}
    s3 = written["policies"]["s3"]
    assert (s3["completed"], s3["failed"]) == (4, 0)
    assert s3["all_outputs_exact_length"] is True
    # the first four Azure conv rows fit under max_len whole, so their lengths are the trace's
    assert s3["output_tokens"] == sum(row.generated_tokens for row in read_trace(config.trace_path, 4))
    assert s3["tokens_per_s"] > 0 and s3["ttft_p50_s"] > 0 and s3["overhead_p50_ms"] is not None
    assert sum(s3["generated_tokens_by_worker"].values()) >= s3["output_tokens"]
    assert len(s3["generated_tokens_by_worker"]) == 2
    assert result["policies"]["s3"]["completed"] == 4


@pytest.mark.slow
def test_natural_bench_runs_to_the_models_own_stop_with_the_probe_on_and_answers_agree(shared_data, model_cache_dir,
                                                                                        tmp_path):
    config = ClusterBenchConfig(
        trace_path=shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv",
        prompts_path=shared_data / "prompts" / "pool.jsonl", policies=("paged_greedy", "s3_peak+probe"),
        num_workers=2, num_requests=4, time_scale=0.0, max_len=160, max_prompt_tokens=64, concurrency=4,
        workload="natural", predictor="default", dtype="float32")  # bf16 answers may change with their batch
    result = cluster_bench.run(config, model_cache_dir=model_cache_dir, json_path=tmp_path / "natural.json")
    written = json.loads(Path(tmp_path / "natural.json").read_text())
    assert written["workload"] == "natural" and len(written["natural"]["split"]["chosen_prompt_ids"]) == 4
    paged, probed = written["policies"]["paged_greedy"], written["policies"]["s3_peak+probe"]
    for summary in (paged, probed):
        assert (summary["completed"], summary["failed"], summary["prompt_tokens_differ"]) == (4, 0, 0)
        assert summary["all_outputs_exact_length"] is None
    # greedy, unforced, fp32: the same answers under both policies (moved or not), and only the probed service
    # read hidden states
    assert written["outputs"]["identical"] is True and paged["output_tokens"] == probed["output_tokens"]
    assert paged["probe_reads"] == 0 and probed["probe_reads"] >= 4  # every prompt's prefill at least
    assert "s3_peak+probe_vs_paged_greedy_tokens_per_s" in result["ratios"]


def test_noisy_oracle_predictions_are_served_from_a_lookup_artifact(tmp_path):
    from benchmarks.cluster_bench_config import ClusterBenchConfig
    from benchmarks.cluster_plan import predictor_artifact
    from benchmarks.http_load import LoadRequest
    from predictor_service.server import LengthPredictorServer

    plan = [LoadRequest(f"r{i}", 0.0, f"prompt number {i}", 5, 500, 20 * (i + 1)) for i in range(4)]
    exact = predictor_artifact(ClusterBenchConfig(predictor="noisy-oracle:0"), plan, tmp_path / "a")
    server = LengthPredictorServer(exact)
    answers = server.predict([{"prompt_text": r.prompt, "num_prompt_tokens": 5, "max_tokens": r.max_tokens}
                              for r in plan])
    assert [a["upper_bound_tokens"] for a in answers] == [20, 40, 60, 80]
    unknown = server.predict([{"prompt_text": "never seen", "num_prompt_tokens": 3, "max_tokens": 77}])
    assert unknown[0]["upper_bound_tokens"] == 77  # unknown prompts get the safe bound
    noisy = LengthPredictorServer(predictor_artifact(ClusterBenchConfig(predictor="noisy-oracle:0.5"), plan,
                                                     tmp_path / "b"))
    bounds = [a["upper_bound_tokens"] for a in noisy.predict(
        [{"prompt_text": r.prompt, "num_prompt_tokens": 5, "max_tokens": r.max_tokens} for r in plan])]
    assert bounds != [20, 40, 60, 80] and all(1 <= b <= 500 for b in bounds)


def test_bad_predictor_spec_is_a_clear_error():
    from benchmarks.cluster_bench_config import ClusterBenchConfig

    with pytest.raises(ValueError, match="SIGMA must be a number"):
        ClusterBenchConfig(predictor="noisy-oracle:x").check()
    with pytest.raises(FileNotFoundError, match="not noisy-oracle"):
        ClusterBenchConfig(predictor="/nope").check()


def test_urgent_share_spreads_priority_0_evenly_and_latency_is_reported_per_class():
    from benchmarks.cluster_plan import BATCH_PRIORITY, priority_of

    classes = [priority_of(i, 0.25) for i in range(20)]
    assert classes.count(0) == 5 and classes.count(BATCH_PRIORITY) == 15
    assert all(0 in classes[i:i + 4] for i in range(0, 20, 4))  # one urgent request in every 4
    assert {priority_of(i, 0.0) for i in range(10)} == {0} and {priority_of(i, 1.0) for i in range(10)} == {0}

    plan = [LoadRequest("u", 0.0, "t", 5, 100, 10, priority=0), LoadRequest("b1", 0.0, "t", 5, 100, 10, priority=5),
            LoadRequest("b2", 0.0, "t", 5, 100, 10, priority=5)]
    results = [make_result("u", first_s=0.1, finished_s=1.0), make_result("b1", first_s=0.5, finished_s=3.0),
               make_result("b2", first_s=0.7, finished_s=5.0)]
    by_class = summarize_results(results, plan)["by_priority"]
    assert by_class["0"]["completed"] == 1 and by_class["0"]["latency_p50_s"] == pytest.approx(1.0)
    assert by_class["5"]["completed"] == 2 and by_class["5"]["latency_p99_s"] == pytest.approx(5.0)
    assert summarize_results(results[:1], plan[:1])["by_priority"] == {}  # one class: nothing per class
    with pytest.raises(ValueError, match="urgent-share"):
        ClusterBenchConfig(urgent_share=1.5).check()


def test_runs_are_compared_with_paging_and_late_binding_with_binding_on_arrival():
    summaries = {"paged_greedy": run(10.0, 4.0, 8.0, 1.0), "s3_peak/late": run(11.0, 3.0, 8.0, 0.5),
                 "s3_peak": run(11.0, 3.6, 9.6, 1.0), "s3/late": run(1.0, 1.0, 1.0, 1.0)}  # no s3 run to pair
    against = ratios_against(summaries, "paged_greedy")
    assert set(against) == {"s3_peak/late", "s3_peak", "s3/late"}
    assert against["s3_peak/late"] == pytest.approx({"tokens_per_s": 1.1, "latency_mean_s": 0.75,
                                                     "latency_p99_s": 1.0, "ttft_p50_s": 0.5})
    late = ratios_against(summaries, "/late")
    assert list(late) == ["s3_peak/late"]
    assert late["s3_peak/late"]["latency_mean_s"] == pytest.approx(3.0 / 3.6)
    assert ratios_against({"s3_peak": run(1.0, 1.0, 1.0, 1.0)}, "paged_greedy") == {}
    routed = {"paged_greedy@room": run(10.0, 4.0, 8.0, 1.0), "s3_peak/late@room": run(11.0, 3.0, 8.0, 0.5),
              "s3_peak@room": run(11.0, 3.6, 9.6, 1.0), "s3_peak@predicted_work": run(9.0, 9.0, 9.0, 9.0)}
    assert set(ratios_against(routed, "paged_greedy")) == {"s3_peak/late@room", "s3_peak@room"}
    assert ratios_against(routed, "/late")["s3_peak/late@room"]["tokens_per_s"] == pytest.approx(1.0)
