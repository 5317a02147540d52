"""Runs one workload through OpenVINO GenAI's ContinuousBatchingPipeline and writes what happened as JSON.

A standalone script for the OpenVINO peer environment (`make peers`: `.venv-openvino`);
it imports only OpenVINO, numpy and the standard library, never this project.
`s3serve bench peers` exports the model to OpenVINO IR once (`optimum-cli export
openvino`, fp16 weights), writes the spec, runs this script and reads the result:

    python benchmarks/openvino_peer.py SPEC.json OUT.json

    SPEC: {"model_dir", "kv_tokens", "max_num_seqs", "max_num_batched_tokens", "precision": "bf16" | "f32",
           "threads", "requests": [{"request_id", "prompt_token_ids", "output_tokens"}, ...],
           "warmup": {"requests": N, "output_tokens": L}, "single": {request} (optional)}
    OUT:  {"wall_s", "startup_s", "output_tokens", "tokens_per_s", "preemptions": null,
           "latency_s": {request_id: seconds}, "exact_lengths", "openvino_version", "scheduler": {...},
           "single": {"output_tokens", "latency_s", "ttft_s"} (with "single")}

The pipeline is driven as its Python users drive it for many requests: every request
added (token ids, `max_new_tokens` = `min_new_tokens` = the forced length,
`ignore_eos`, greedy), then `step()` until none is left; a request's latency runs from
the start to the step after which it reports finished. KV: `num_kv_blocks` of the
CPU's 32-token blocks, as many as the budget holds; K and V in `precision` (the CPU
plugin's default would be u8, and the export writes f16 into the model: both are
overridden, so the cache holds the same bytes per token as ours). Compute precision
the same (`INFERENCE_PRECISION_HINT`); threads at the cores given, the rest at the
CPU plugin's defaults (latency hint: one stream, pinned). OpenVINO preempts by
recomputing a victim's tail blocks and exposes no count of it: "preemptions" is null.
"""

import sys
import time

CPU_BLOCK_TOKENS = 32  # the CPU plugin's KV block (openvino.genai's kv_cache_manager)


def _pipeline(spec: dict):
    import openvino_genai as genai

    scheduler = genai.SchedulerConfig()
    scheduler.num_kv_blocks = spec["kv_tokens"] // CPU_BLOCK_TOKENS
    scheduler.cache_size = 0
    scheduler.max_num_seqs = spec["max_num_seqs"]
    scheduler.max_num_batched_tokens = spec["max_num_batched_tokens"]
    scheduler.enable_prefix_caching = False
    properties = {"KV_CACHE_PRECISION": spec["precision"], "INFERENCE_PRECISION_HINT": spec["precision"],
                  "INFERENCE_NUM_THREADS": spec["threads"]}
    return genai.ContinuousBatchingPipeline(spec["model_dir"], scheduler, "CPU", properties), scheduler


def _config(output_tokens: int):
    import openvino_genai as genai

    return genai.GenerationConfig(max_new_tokens=output_tokens, min_new_tokens=output_tokens, ignore_eos=True,
                                  do_sample=False)


def _tensor(token_ids: list[int]):
    import numpy
    import openvino

    return openvino.Tensor(numpy.asarray([token_ids], dtype=numpy.int64))  # [1, prompt tokens]


def _replay(pipe, requests: list[dict]) -> dict:
    """Every request added at once, stepped until all finish."""
    import openvino_genai as genai

    running = {}
    for index, request in enumerate(requests):
        handle = pipe.add_request(index, _tensor(request["prompt_token_ids"]), _config(request["output_tokens"]))
        running[index] = handle
    begin_s = time.monotonic()
    latency_s, output_tokens, exact = {}, 0, True
    while pipe.has_non_finished_requests():
        pipe.step()
        now_s = time.monotonic() - begin_s
        for index in [i for i, handle in running.items() if handle.get_status() != genai.GenerationStatus.RUNNING]:
            handle = running.pop(index)
            request = requests[index]
            if handle.get_status() != genai.GenerationStatus.FINISHED:
                raise RuntimeError(f"request {request['request_id']} ended {handle.get_status()}")
            got = len(handle.read_all()[0].generated_ids)
            latency_s[request["request_id"]] = now_s
            output_tokens += got
            exact &= got == request["output_tokens"]
    wall_s = time.monotonic() - begin_s
    if running:
        raise RuntimeError(f"{len(running)} requests never finished")
    return {"wall_s": wall_s, "output_tokens": output_tokens, "tokens_per_s": output_tokens / wall_s,
            "latency_s": latency_s, "exact_lengths": exact}


def _single(pipe, request: dict) -> dict:
    """One request alone: its tokens, the time to its first token and to its last."""
    import openvino_genai as genai

    begin_s = time.monotonic()
    handle = pipe.add_request(0, _tensor(request["prompt_token_ids"]), _config(request["output_tokens"]))
    first_s = None
    while pipe.has_non_finished_requests():
        pipe.step()
        if first_s is None and handle.can_read():
            first_s = time.monotonic() - begin_s
    total_s = time.monotonic() - begin_s
    if handle.get_status() != genai.GenerationStatus.FINISHED:
        raise RuntimeError(f"the single request ended {handle.get_status()}")
    return {"output_tokens": len(handle.read_all()[0].generated_ids), "latency_s": total_s,
            "ttft_s": first_s or total_s}


def run(spec: dict) -> dict:
    import openvino_genai as genai

    start_s = time.monotonic()
    pipe, scheduler = _pipeline(spec)
    requests = spec["requests"]
    warmup = spec["warmup"]
    _replay(pipe, [{"request_id": f"warmup-{i}", "prompt_token_ids": requests[i % len(requests)]["prompt_token_ids"],
                    "output_tokens": warmup["output_tokens"]} for i in range(warmup["requests"])])
    startup_s = time.monotonic() - start_s
    result = {**_replay(pipe, requests), "startup_s": startup_s, "preemptions": None,
              "openvino_version": genai.__version__,
              "scheduler": {"num_kv_blocks": scheduler.num_kv_blocks, "block_tokens": CPU_BLOCK_TOKENS,
                            "max_num_seqs": scheduler.max_num_seqs,
                            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
                            "dynamic_split_fuse": scheduler.dynamic_split_fuse, "threads": spec["threads"],
                            "precision": spec["precision"]}}
    if spec.get("single"):
        result["single"] = _single(pipe, spec["single"])
    return result


if __name__ == "__main__":
    from peer_script_main import main  # beside this script: the standard library only

    sys.exit(main(run, "openvino_peer.py"))
