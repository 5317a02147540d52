"""`s3serve bench policies`: the four scheduling policies on one model, workload and KV budget.

Each policy gets a fresh engine over the same model weights and the same
replayed trace (real prompt text, outputs forced to the trace's lengths), with
the same KV budget. By default the budget is what worst-case reservation
needs for `reserve_slots` sequences of `max_len` tokens: memory binds, as on a
GPU, and the policies differ only in what they reserve.
"""

import copy
from pathlib import Path

from tqdm import tqdm

from benchmarks.natural_workload import Labeler, build_natural_workload, compare_outputs
from benchmarks.noisy_oracle import NoisyOraclePredictor
from benchmarks.policy_bench_config import POLICIES, PolicyBenchConfig
from benchmarks.policy_plots import plot_runs
from benchmarks.policy_replay import WARMUP_REQUESTS, PolicyRun, run_policy
from benchmarks.policy_summary import CACHE_COMPARED, PROBE_SUFFIX, PROBED, policy_ratios, summarize
from benchmarks.report import environment, format_table, write_json
from benchmarks.traces import MOONCAKE_BLOCK_TOKENS, build_requests, load_prompt_texts, read_trace, select_sessions
from cluster.control.worker_probe import load_length_probe
from predictor_service.artifacts import load_predictor
from predictor_service.length_example import TextOf
from predictor_service.length_predictor import LengthPredictor, LengthQuery
from predictor_service.server import DEFAULT_ARTIFACT_ROOT
from workers.engine.model_runner import pool_shape_for
from workers.engine.linear_weights import as_served, has_bf16_linear_weights, precision_label
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir


def parse_predictor(spec: str, true_lengths: dict[str, int], max_len: int, seed: int,
                    text_of: TextOf | None = None) -> LengthPredictor:
    """`noisy-oracle:SIGMA`, `default` (the service's shipped predictor), or a trained predictor artifact
    directory (a version or a root with LATEST).

    A trained predictor reads the prompt's text through `text_of(query)`; the
    replayed prompts are real text cut to length, so decoding their tokens gives it.
    """
    if spec.startswith("noisy-oracle:"):
        try:
            sigma = float(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"--predictor {spec!r}: SIGMA must be a number, e.g. noisy-oracle:0.3") from None
        return NoisyOraclePredictor(true_lengths, sigma=sigma, max_len=max_len, seed=seed)
    if spec == "default":
        spec = str(DEFAULT_ARTIFACT_ROOT)
    if not Path(spec).is_dir():
        raise ValueError(f"--predictor {spec!r} is neither noisy-oracle:SIGMA nor a predictor artifact directory")
    predictor = load_predictor(spec)
    predictor.text_of = text_of
    return predictor


def _bench_model(config: PolicyBenchConfig, model_dir: Path, vocab_size: int):
    """The served model's weights (fp32; over bf16 linear weights where the service reads them so, see
    `as_served`), or a random model of `config.model_shape` (bf16 on CUDA)."""
    import torch

    if config.model_shape is None:
        return as_served(load_model(model_dir, device=config.device), config.device)
    from workers.engine.model_shapes import make_shaped_model, shape_parameters

    dtype = torch.bfloat16 if config.device.startswith("cuda") else torch.float32
    print(f"model shape {config.model_shape}: {shape_parameters(config.model_shape) / 1e9:.2f} B parameters "
          f"(random, {dtype}, {config.device}; vocabulary raised to the tokenizer's {vocab_size} if smaller)")
    return make_shaped_model(config.model_shape, vocab_size=vocab_size, dtype=dtype, device=config.device,
                             max_position_embeddings=max(config.max_len, 512))


def run(config: PolicyBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None, plot_dir: Path | None = None, labeler: Labeler | None = None) -> dict:
    """Run every policy (and the sigma sweep), print tables, write JSON and plots.

    `labeler` labels held-out prompts the natural workload's labels file lacks (without it, that is an error)."""
    if config.mode not in ("offline", "online"):
        raise ValueError(f"--mode must be offline or online, got {config.mode!r}")
    if config.workload not in ("trace", "natural"):
        raise ValueError(f"--workload must be trace or natural, got {config.workload!r}")
    unknown = [p for p in config.policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    for spec in [config.predictor] + [f"noisy-oracle:{sigma}" for sigma in config.sweep_sigmas]:
        parse_predictor(spec, {}, config.max_len, config.seed)  # fail on a bad spec before loading anything
    natural = config.workload == "natural"
    if config.probe is not None and not natural:
        raise ValueError("--probe needs --workload natural: forced trace lengths are not the model's to predict")
    if natural and config.model_shape is not None:
        raise ValueError("--workload natural needs the model's own weights (it answers until the model stops); "
                         "drop --model-shape")
    rows = [] if natural else read_trace(config.trace_path, config.num_requests)
    shares_prefixes = not natural and any(row.hash_ids for row in rows)
    if shares_prefixes:  # whole conversations: the first N rows of Mooncake barely share (traces docstring)
        rows = select_sessions(read_trace(config.trace_path), config.num_requests)
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    if natural:
        workload = build_natural_workload(
            tokenizer, model_name, config.num_requests, config.max_len, config.max_prompt_tokens, config.mode, config.time_scale,
            config.trace_path, config.labels_path, config.prompts_path, config.seed, labeler)
        requests, workload_info = workload.requests, workload.describe()
        print(f"natural workload: {len(requests)} held-out prompts of {config.prompts_path} (none of the "
              f"{workload_info['split']['num_trained_prompts']} the shipped predictor trained on), greedy to the "
              f"model's own stop; mean prompt {workload_info['mean_prompt_tokens']:.0f} tokens, mean answer "
              f"{workload_info['mean_output_tokens']:.0f} tokens, {workload_info['hit_length_limit_fraction']:.0%} "
              f"reach max_tokens (labels: {config.labels_path})")
    else:
        requests, capping = build_requests(
            rows, tokenizer, load_prompt_texts(config.prompts_path), max_len=config.max_len,
            max_prompt_tokens=config.max_prompt_tokens, mode=config.mode, time_scale=config.time_scale,
            tokens_per_hash_id=config.tokens_per_hash_id if shares_prefixes else None,
        )
        workload_info = {"description": capping.describe(), "num_prompt_capped": capping.num_prompt_capped,
                         "num_output_capped": capping.num_output_capped,
                         "mean_prompt_tokens": capping.mean_prompt_tokens,
                         "mean_output_tokens": capping.mean_output_tokens}
        print(f"trace {config.trace_path}: {capping.describe()}")
    if shares_prefixes:
        print(f"shared prefixes: {len(rows)} rows of the {len({r.hash_ids[0] for r in rows if r.hash_ids})} largest sessions; "
              f"each hash id is {config.tokens_per_hash_id} tokens of shared text (trace: {MOONCAKE_BLOCK_TOKENS}, "
              f"scale 1/{MOONCAKE_BLOCK_TOKENS // config.tokens_per_hash_id}), prompts capped at "
              f"{config.max_prompt_tokens}")
    model = _bench_model(config, model_dir, len(tokenizer))
    precision = precision_label(model.dtype, has_bf16_linear_weights(model))
    if config.model_shape is None:
        print(f"model {model_name}: {precision}, as served here")
    pool = pool_shape_for(model.config, 1, 16, model.dtype)
    bytes_per_token = pool.bytes_per_block // pool.block_size
    kv_cache_bytes = config.kv_cache_bytes or config.reserve_slots * config.max_len * bytes_per_token
    true_lengths = {r.request_id: r.output_tokens for r in requests}
    queries = [LengthQuery(r.request_id, r.prompt_token_ids, config.max_len - len(r.prompt_token_ids))
               for r in requests]

    def text_of(query: LengthQuery) -> str:
        if natural:  # the message text, as the predictor trained on and as the service passes it
            return workload.texts[query.prompt_id]
        return tokenizer.decode(list(query.prompt_token_ids), skip_special_tokens=True)

    def estimates_for(spec: str) -> dict[str, tuple[int, int]]:  # request -> (point, upper bound)
        predictor = parse_predictor(spec, true_lengths, config.max_len, config.seed, text_of)
        return {q.prompt_id: (p.point_tokens, p.upper_bound_tokens)
                for q, p in zip(queries, predictor.predict(queries))}

    estimates_by_spec = {config.predictor: estimates_for(config.predictor)}
    probe = None
    if config.probe is not None:
        probe = load_length_probe(config.probe, model.config.hidden_size)
    # (policy, predictor spec, is a sweep run, prefix caching, probe)
    plan = [(name, config.predictor, False, config.prefix_caching, None) for name in config.policies]
    if probe is not None:
        plan += [(name, config.predictor, False, config.prefix_caching, probe) for name in PROBED
                 if name in config.policies]
    if shares_prefixes and config.prefix_caching:
        plan += [(name, config.predictor, False, False, None) for name in config.policies if name in CACHE_COMPARED]
    plan += [(name, f"noisy-oracle:{sigma}", True, config.prefix_caching, None) for sigma in config.sweep_sigmas
             for name in ("s3", "s3_peak") if name in config.policies]
    runs: list[PolicyRun] = []
    sweep: list[dict] = []
    with tqdm(total=len(plan) * len(requests), desc="requests (all policies)", unit="req") as progress:
        for name, spec, is_sweep, caching, run_probe in plan:
            shown = name if run_probe is None else f"{name}{PROBE_SUFFIX}"
            progress.set_postfix_str(f"{shown} {spec}" if name.startswith("s3") else shown)
            if spec not in estimates_by_spec:
                estimates_by_spec[spec] = estimates_for(spec)
            # A fresh copy per run: each engine installs its own attention and DeepSpeed wrapper.
            estimates = ({rid: (n, n) for rid, n in true_lengths.items()} if natural and name == "oracle"
                         else estimates_by_spec[spec])
            result = run_policy(copy.deepcopy(model), name, requests, estimates, config, kv_cache_bytes,
                                progress, caching, run_probe)
            if not is_sweep:
                runs.append(result)
            else:
                summary = summarize(result, len(requests))
                sweep.append({"policy": name, "predictor": spec, "tokens_per_s": summary["tokens_per_s"],
                              "preemptions": summary["preemptions"], "mispredictions": summary["mispredictions"],
                              "recomputed_tokens": summary["recomputed_tokens"],
                              "mean_concurrency": summary["mean_concurrency"]})
    summaries = {r.policy: summarize(r, len(requests)) for r in runs}
    ratios = policy_ratios(summaries)
    print(f"preemption: {config.preemption_mode} for every policy, swap space {config.swap_space_bytes / 1e6:.0f} MB "
          f"(beyond it, recompute); each engine warmed up untimed with the same {WARMUP_REQUESTS} requests")
    headers = ["policy", "tok/s", "req/s", "conc_mean", "conc_max", "kv_used", "kv_resv", "preempt",
               "recomp_tok", "swap_MB", "swap_peak_MB", "lat_mean", "lat_p50", "lat_p99", "ttft_p50", "ttft_p99",
               "tpot_p50", "prefix_hit"]
    table_rows = [[name, s["tokens_per_s"], s["requests_per_s"], s["mean_concurrency"], s["max_concurrency"],
                   s["kv_used_fraction_mean"], s["kv_reserved_fraction_mean"], s["preemptions"],
                   s["recomputed_tokens"], s["swapped_bytes"] / 1e6, s["swap_space_peak_bytes"] / 1e6,
                   s["latency_mean_s"], s["latency_p50_s"], s["latency_p99_s"],
                   s["ttft_p50_s"], s["ttft_p99_s"], s["tpot_p50_s"],
                   s["prefix_hit_rate"] if s["prefix_caching"] else "off"] for name, s in summaries.items()]
    print(format_table(headers, table_rows))
    print(format_table(["ratio", "value"], [[k, v if v is not None else "n/a"] for k, v in ratios.items()]))
    buckets = sorted({int(b) for s in summaries.values() for b in s["step_ms_by_batch"]})
    print("step ms by sequences in the step:")
    print(format_table(["policy", *[f"{b}+" for b in buckets]],
                       [[name, *[s["step_ms_by_batch"].get(str(b), "-") for b in buckets]]
                        for name, s in summaries.items()]))
    if natural:
        token_check = compare_outputs({r.policy: r.digests for r in runs})
        workload_info["identical_tokens"] = token_check
        print("tokens per request: " + ("identical under every policy" if token_check["identical"] else
              "DIFFER from " + token_check["reference"] + "'s: " +
              "; ".join(f"{name} {len(ids)} requests" for name, ids in token_check["differing"].items())))
    if sweep:
        print(format_table(["policy", "predictor", "tok/s", "preempt", "mispred", "recomp_tok", "conc_mean"],
                           [[s["policy"], s["predictor"], s["tokens_per_s"], s["preemptions"], s["mispredictions"],
                             s["recomputed_tokens"], s["mean_concurrency"]] for s in sweep]))
    result = {
        "benchmark": "policies",
        "model": model_name if config.model_shape is None else f"random {config.model_shape} shape",
        "device": config.device,
        "trace": str(config.trace_path),
        "mode": config.mode,
        "time_scale": config.time_scale,
        "num_requests": len(requests),
        "max_len": config.max_len,
        "predictor": config.predictor,
        "kv_cache_bytes": kv_cache_bytes,
        "preemption_mode": config.preemption_mode,
        "swap_space_bytes": config.swap_space_bytes,
        "warmup_requests": WARMUP_REQUESTS,
        "kv_blocks": runs[0].num_blocks if runs else None,
        "max_reserve_slots": kv_cache_bytes // (config.max_len * bytes_per_token),
        "workload": config.workload,
        "precision": precision,
        ("natural" if natural else "capping"): workload_info,
        "policies": summaries,
        "ratios": ratios,
        "sigma_sweep": sweep,
        "environment": environment(),
    }
    if plot_dir is not None and runs:
        result["plots"] = [str(p) for p in plot_runs(runs, summaries, Path(plot_dir))]
    write_json(json_path, result)
    return result
