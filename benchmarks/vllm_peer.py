"""Runs one workload through vLLM's Python API and writes what happened as JSON.

A standalone script for the peer virtual environment (`make peers`): it imports
only vLLM and the standard library, never this project. `s3serve bench peers`
writes the spec, starts it under `.venv-peers/bin/python` with vLLM's CPU
tuning in the environment, and reads the result:

    python benchmarks/vllm_peer.py SPEC.json OUT.json

    SPEC: {"model_dir", "kv_cache_bytes", "max_model_len", "seed",
           "requests": [{"request_id", "prompt_token_ids", "output_tokens"}, ...]}
    OUT:  {"wall_s", "startup_s", "output_tokens", "tokens_per_s", "preemptions",
           "latency_s": {request_id: seconds}, "exact_lengths", "vllm_version", "scheduler": {...}}

Every request is added at t=0 and the engine is stepped until all finish; a
request's latency is the time from then to the step that finished it.
"""

import json
import sys
import time


def run(spec: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start_s = time.monotonic()
    llm = LLM(
        model=spec["model_dir"], dtype="bfloat16", max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"], seed=spec["seed"], disable_log_stats=False,
    )
    startup_s = time.monotonic() - start_s
    engine = llm.llm_engine
    expected = {}
    for request in spec["requests"]:
        params = SamplingParams(max_tokens=request["output_tokens"], ignore_eos=True, temperature=0.0)
        engine_id = engine.add_request(request["request_id"],
                                       TokensPrompt(prompt_token_ids=request["prompt_token_ids"]), params)
        # outputs carry the caller's id; keep the engine's own as well in case a version reports that one
        expected[request["request_id"]] = expected[engine_id] = (request["request_id"], request["output_tokens"])
    begin_s = time.monotonic()
    latency_s: dict[str, float] = {}
    output_tokens = 0
    exact = True
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                request_id, want = expected[output.request_id]
                latency_s[request_id] = time.monotonic() - begin_s
                got = len(output.outputs[0].token_ids)
                output_tokens += got
                exact &= got == want
    wall_s = time.monotonic() - begin_s
    preemptions = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:num_preemptions":
            preemptions += int(getattr(metric, "value", 0))
    scheduler = engine.vllm_config.scheduler_config
    return {
        "wall_s": wall_s,
        "startup_s": startup_s,
        "output_tokens": output_tokens,
        "tokens_per_s": output_tokens / wall_s,
        "preemptions": preemptions,
        "latency_s": latency_s,
        "exact_lengths": exact,
        "vllm_version": vllm.__version__,
        "scheduler": {"max_num_seqs": scheduler.max_num_seqs,
                      "max_num_batched_tokens": scheduler.max_num_batched_tokens},
    }


def main() -> int:
    if len(sys.argv) != 3:
        print("usage: vllm_peer.py SPEC.json OUT.json", file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8") as spec_file:
        spec = json.load(spec_file)
    result = run(spec)
    with open(sys.argv[2], "w", encoding="utf-8") as out_file:
        json.dump(result, out_file)
    return 0


if __name__ == "__main__":  # vLLM spawns its engine process: the guard keeps it from re-running this
    sys.exit(main())
