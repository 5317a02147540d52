"""Runs one workload through vLLM's Python API and writes what happened as JSON.

A standalone script for the peer virtual environment (`make peers`): it imports
only vLLM and the standard library, never this project. `s3serve bench peers`
writes the spec, starts it under `.venv-peers/bin/python` with vLLM's CPU
tuning in the environment, and reads the result:

    python benchmarks/vllm_peer.py SPEC.json OUT.json

    SPEC: {"model_dir", "kv_cache_bytes", "dtype" ("bfloat16" or "float32"; default bfloat16), "max_model_len", "seed",
           "requests": [{"request_id", "prompt_token_ids", "output_tokens"}, ...],
           "online": {"unit_arrivals_s": [...], "rate_fractions": [...],
                      "warmup": {"prompts": [[token ids], ...], "output_tokens"}},  (optional)
           "single": {"request_id", "prompt_token_ids", "output_tokens"}}  (optional)
    OUT:  {"wall_s", "startup_s", "output_tokens", "tokens_per_s", "preemptions",
           "latency_s": {request_id: seconds}, "exact_lengths", "vllm_version", "scheduler": {...},
           "online": [{"rate_fraction", "rate_per_s", <the fields of a run>, "ttft_s", "tpot_s"}, ...],
           "single": {"output_tokens", "latency_s", "ttft_s"}}

Every request is added at t=0 and the engine is stepped until all finish; a
request's latency is the time from then to the step that finished it. With
"online", the warm-up requests run first (untimed), then that offline run sets
the capacity (requests/s); then for each fraction f the same requests arrive at
f x capacity, request i at unit_arrivals_s[i] / rate (the caller's seeded
Poisson times at 1 request/s), each added before the first step after its
arrival. Latency and TTFT count from the arrival. With "single", that request
runs alone after the rest: what one user with the machine to themselves sees. The prefix cache is emptied
before every run, so no run reuses an earlier one's prompts.
"""

import sys
import time


def _preemptions(llm) -> int:
    return sum(int(getattr(metric, "value", 0)) for metric in llm.get_metrics()
               if metric.name == "vllm:num_preemptions")


def _replay(llm, requests: list[dict], arrivals_s: list[float], tag: str) -> dict:
    """Add each request at its arrival (seconds after the start), step until all finish; what happened."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    llm.reset_prefix_cache()
    preempted_before = _preemptions(llm)
    order = sorted(range(len(requests)), key=lambda i: arrivals_s[i])
    expected, arrived_s = {}, {}
    latency_s: dict[str, float] = {}
    ttft_s: dict[str, float] = {}
    tpot_s: dict[str, float] = {}
    output_tokens, exact, next_index = 0, True, 0
    begin_s = time.monotonic()
    while next_index < len(order) or engine.has_unfinished_requests():
        now_s = time.monotonic() - begin_s
        if not engine.has_unfinished_requests() and arrivals_s[order[next_index]] > now_s:
            time.sleep(arrivals_s[order[next_index]] - now_s)
            now_s = time.monotonic() - begin_s
        while next_index < len(order) and arrivals_s[order[next_index]] <= now_s:
            request = requests[order[next_index]]
            params = SamplingParams(max_tokens=request["output_tokens"], ignore_eos=True, temperature=0.0)
            run_id = f"{tag}-{request['request_id']}"
            engine_id = engine.add_request(run_id, TokensPrompt(prompt_token_ids=request["prompt_token_ids"]),
                                           params)
            # outputs carry the caller's id; keep the engine's own as well in case a version reports that one
            expected[run_id] = expected[engine_id] = (request["request_id"], request["output_tokens"])
            arrived_s[request["request_id"]] = arrivals_s[order[next_index]]
            next_index += 1
        for output in engine.step():
            request_id, want = expected[output.request_id]
            now_s = time.monotonic() - begin_s
            got = len(output.outputs[0].token_ids)
            if got and request_id not in ttft_s:
                ttft_s[request_id] = now_s - arrived_s[request_id]
            if output.finished:
                latency_s[request_id] = now_s - arrived_s[request_id]
                tpot_s[request_id] = (latency_s[request_id] - ttft_s[request_id]) / max(1, got - 1)
                output_tokens += got
                exact &= got == want
    wall_s = time.monotonic() - begin_s
    return {"wall_s": wall_s, "output_tokens": output_tokens, "tokens_per_s": output_tokens / wall_s,
            "preemptions": _preemptions(llm) - preempted_before, "latency_s": latency_s, "ttft_s": ttft_s,
            "tpot_s": tpot_s, "exact_lengths": exact}


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM

    start_s = time.monotonic()
    llm = LLM(
        model=spec["model_dir"], dtype=spec.get("dtype", "bfloat16"), max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=spec["seed"], disable_log_stats=False,
    )
    startup_s = time.monotonic() - start_s
    requests = spec["requests"]
    online = spec.get("online")
    if online:  # the same untimed warm-up our engines get (`benchmarks.policy_replay.warm_up`)
        warmup = [{"request_id": f"warmup-{i}", "prompt_token_ids": ids,
                   "output_tokens": online["warmup"]["output_tokens"]}
                  for i, ids in enumerate(online["warmup"]["prompts"])]
        _replay(llm, warmup, [0.0] * len(warmup), "warmup")
    offline = _replay(llm, requests, [0.0] * len(requests), "offline")
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    result = {
        **offline,
        "startup_s": startup_s,
        "vllm_version": vllm.__version__,
        "scheduler": {"max_num_seqs": scheduler.max_num_seqs,
                      "max_num_batched_tokens": scheduler.max_num_batched_tokens},
    }
    if spec.get("single"):
        alone = _replay(llm, [spec["single"]], [0.0], "single")
        request_id = spec["single"]["request_id"]
        result["single"] = {"output_tokens": alone["output_tokens"], "latency_s": alone["latency_s"][request_id],
                            "ttft_s": alone["ttft_s"][request_id]}
    if online:
        capacity_per_s = len(requests) / offline["wall_s"]
        result["capacity_requests_per_s"] = capacity_per_s
        result["online"] = []
        for fraction in online["rate_fractions"]:
            rate_per_s = fraction * capacity_per_s
            arrivals_s = [unit / rate_per_s for unit in online["unit_arrivals_s"]]
            replay = _replay(llm, requests, arrivals_s, f"rate{fraction:g}")
            result["online"].append({"rate_fraction": fraction, "rate_per_s": rate_per_s, **replay})
    return result


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from re-running this
    from peer_script_main import main  # beside this script: the standard library only

    sys.exit(main(run, "vllm_peer.py"))
