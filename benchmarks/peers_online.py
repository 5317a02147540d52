"""`s3serve bench peers --workload natural`: ours and vLLM on held-out prompts arriving online, at several rates.

The work is identical on both sides: held-out pool prompts (`benchmarks.natural_workload`),
each answered for exactly the served model's own greedy length from the labels file, forced
with `ignore_eos` on both systems (greedy, so the tokens are the model's own answer). The
lengths are ones a predictor can learn from the prompt; ours predicts them with the shipped
predictor, as the service does by default (the oracle run, which reads them, is the ceiling).

One vLLM process (`benchmarks/vllm_peer.py`) warms up with the same requests our engines warm
up with, runs the requests all at t=0 to measure its offline capacity, then replays them at
each fraction of that capacity (`rate_fractions`, requests/s), request i arriving at
`unit_arrivals_s[i] / rate`: seeded Poisson times drawn here, so our runs see the same arrival
times. Both systems get the same KV tokens and preempt by recomputing (vLLM V1's only
mechanism); each of our runs is a fresh engine, warmed up untimed, and vLLM empties its prefix
cache before every run. One timed run per system, policy and rate.
"""

import copy
import dataclasses
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.natural_workload import HELD_OUT_LABELS, Labeler, build_natural_workload
from benchmarks.peers_bench import PeersBenchConfig, model_config, peer_python, run_vllm
from benchmarks.policy_bench import parse_predictor
from benchmarks.policy_bench_config import DEFAULT_TRACE, PolicyBenchConfig
from benchmarks.policy_replay import WARMUP_OUTPUT_TOKENS, run_policy, warm_up_prompts
from benchmarks.report import environment, format_table, percentile, write_json
from cluster.control.worker_probe import load_length_probe
from predictor_service.length_predictor import LengthQuery
from workers.engine.model_runner import pool_shape_for
from workers.engine.linear_weights import as_served
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.engine.runtime import resolve_dtype
from workers.scheduling.length_probe import LengthProbe
from workers.scheduling.policies import DEFAULT_POLICY

ORACLE = "oracle"  # in `policies`: the default policy planning by the true lengths, the ceiling
PROBED = "probe"  # in `policies`: the default policy with the hidden-state probe re-predicting inside the engine


@dataclasses.dataclass(frozen=True, slots=True)
class NaturalPeersConfig:
    """What `bench peers --workload natural` runs.

    Attributes:
        num_requests, max_len, max_prompt_tokens: the held-out prompts (`build_natural_workload`).
        labels_path: the served model's greedy lengths (missing prompts are labelled first).
        rate_fractions: arrival rates as fractions of vLLM's offline capacity in requests/s.
        kv_tokens: KV tokens of every engine (vLLM's bytes are those of its dtype, ours: bf16 or fp32).
        policies: our policies; "oracle" runs the default policy (s3_peak) on the true lengths instead of the
            predictor's (the ceiling of what better prediction could give it); "probe" runs it with `probe`
            re-predicting each answer's remaining length from the engine's hidden states (after prefill, then
            every 64 decoded tokens), as `--length-probe` does in the service.
        probe: the hidden-state probe of "probe" ("default": the shipped SmolLM2 one, left out for another model
            unless "probe" was asked for; or a folder from `s3serve probe train`).
        predictor: what our length-aware policies predict with ("default": the shipped predictor).
        peers: the P8 bench's settings this shares (peer venv, timeouts, step limits, dtype, seed, systems).
    """

    num_requests: int = 64
    max_len: int = 1024
    max_prompt_tokens: int = 256
    labels_path: Path = HELD_OUT_LABELS
    trace_path: Path = DEFAULT_TRACE
    rate_fractions: tuple[float, ...] = (0.6, 0.9, 1.2, 1.5)
    kv_tokens: int = 4096
    policies: tuple[str, ...] = ("paged_greedy", DEFAULT_POLICY, PROBED, ORACLE)
    predictor: str = "default"
    probe: str = "default"
    peers: PeersBenchConfig = PeersBenchConfig(max_num_seqs=128, max_num_batched_tokens=512, systems=("vllm", "ours"))


def quick_config(**overrides) -> NaturalPeersConfig:
    # paging, the default policy as the service runs it for the default model (with the probe), and the ceiling
    return NaturalPeersConfig(**{"num_requests": 32, "max_len": 512, "max_prompt_tokens": 128, "kv_tokens": 2048,
                                 "rate_fractions": (0.9, 1.2, 1.5), "policies": ("paged_greedy", PROBED, ORACLE),
                                 **overrides})


def service_default(policies: tuple[str, ...]) -> str:
    """The row that stands for the service's default (the headline ratios): s3_peak with the probe where it runs."""
    return f"{DEFAULT_POLICY}+probe" if PROBED in policies else DEFAULT_POLICY


def unit_arrivals(num_requests: int, seed: int) -> list[float]:
    """Poisson arrival times at 1 request/s (seeded): request i at the sum of i + 1 exponential gaps."""
    import numpy

    gaps = numpy.random.default_rng(seed).exponential(1.0, num_requests)
    return numpy.cumsum(gaps).tolist()


def run(config: NaturalPeersConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None, log_dir: Path | None = None, labeler: Labeler | None = None) -> dict:
    """vLLM offline then at every rate; then each of our policies at the same rates and arrival times."""
    systems = config.peers.systems
    if "vllm" in systems:
        peer_python(config.peers)  # fail before loading anything
    if not config.rate_fractions or any(f <= 0 for f in config.rate_fractions):
        raise ValueError(f"--rates must be positive fractions of vLLM's capacity, got {list(config.rate_fractions)}")
    if config.kv_tokens < config.max_len:
        raise ValueError(f"--kv-tokens {config.kv_tokens} cannot hold one {config.max_len}-token sequence")
    if config.max_len <= config.max_prompt_tokens:
        raise ValueError(f"--max-len {config.max_len} leaves no room to answer a prompt of up to "
                         f"{config.max_prompt_tokens} tokens")
    parse_predictor(config.predictor, {}, config.max_len, config.peers.seed)  # a bad spec fails here
    if PROBED in config.policies and config.probe == "default" and model_name != DEFAULT_MODEL \
            and config.policies in (NaturalPeersConfig.policies, quick_config().policies):
        print(f"no s3_peak+probe runs: the shipped probe reads {DEFAULT_MODEL}'s hidden states; pass --probe DIR "
              "(from `s3serve probe extract` and `train`) for this model")
        without = dict.fromkeys(DEFAULT_POLICY if p == PROBED else p for p in config.policies)  # ordered, unique
        config = dataclasses.replace(config, policies=tuple(without))
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    workload = build_natural_workload(tokenizer, model_name, config.num_requests, config.max_len,
                                      config.max_prompt_tokens, "offline", 1.0, config.trace_path,
                                      config.labels_path, config.peers.prompts_path, config.peers.seed, labeler)
    requests = workload.requests
    info = workload.describe()
    print(f"natural workload: {len(requests)} held-out prompts, mean prompt {info['mean_prompt_tokens']:.0f} tokens, "
          f"outputs forced to the model's own greedy lengths (mean {info['mean_output_tokens']:.0f}, "
          f"{info['hit_length_limit_fraction']:.0%} at max_tokens) on both systems; Poisson arrivals (seed "
          f"{config.peers.seed}) at {', '.join(f'{f:g}x' for f in config.rate_fractions)} "
          f"{'vLLM' if 'vllm' in systems else 'our paged_greedy'}'s offline capacity")
    units = unit_arrivals(len(requests), config.peers.seed)
    dtype = resolve_dtype(config.peers.dtype, "cpu")
    # dtype auto on an AVX2-only CPU: fp32 over bf16 linear weights
    model = as_served(load_model(model_dir, dtype=dtype), "cpu", config.peers.dtype) if "ours" in systems else None
    hf_config = model_config(model_dir)
    our_bytes = pool_shape_for(hf_config, 1, 1, dtype).bytes_per_block
    # vLLM computes in bf16 where we do, else in fp32 (its bf16 path needs bf16 instructions): our KV dtype's bytes
    vllm_dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
    runs: list[dict] = []
    capacity_per_s = None
    if "vllm" in systems:
        capacity_per_s = _run_vllm(config, model_dir, requests, units, config.kv_tokens * our_bytes, vllm_dtype,
                                   len(tokenizer), log_dir, runs)
    if "ours" in systems:
        if capacity_per_s is None:  # no vLLM here: our paged_greedy's offline capacity sets the rates
            capacity_per_s = _offline_capacity(model, requests, config, config.kv_tokens * our_bytes)
        estimates = _estimates(config, requests, workload.texts)
        probe = load_length_probe(config.probe, model.config.hidden_size) if PROBED in config.policies else None
        if probe is not None:
            probe.reads_forced = True  # every forced length here is the model's own greedy one
        plan = [(policy, f) for f in config.rate_fractions for policy in config.policies]
        with tqdm(total=len(plan), desc="ours", unit="run") as progress:
            for policy, fraction in plan:
                progress.set_postfix_str(f"{policy} {fraction:g}x")
                rate = fraction * capacity_per_s
                timed = [dataclasses.replace(r, arrival_s=u / rate) for r, u in zip(requests, units)]
                runs.append(_run_ours(model, policy, timed, estimates, config, config.kv_tokens * our_bytes,
                                      fraction, rate, str(dtype).removeprefix("torch."), probe))
                progress.update(1)
    return _report(config, runs, info, capacity_per_s, json_path)


def _estimates(config: NaturalPeersConfig, requests, texts: dict[str, str]) -> dict[str, tuple[int, int]]:
    """(point, upper bound) per request from the configured predictor, reading each prompt's message text."""
    true_lengths = {r.request_id: r.output_tokens for r in requests}
    predictor = parse_predictor(config.predictor, true_lengths, config.max_len, config.peers.seed,
                                lambda query: texts[query.prompt_id])
    queries = [LengthQuery(r.request_id, r.prompt_token_ids, config.max_len - len(r.prompt_token_ids))
               for r in requests]
    return {q.prompt_id: (p.point_tokens, p.upper_bound_tokens) for q, p in zip(queries, predictor.predict(queries))}


def _bench_config(config: NaturalPeersConfig) -> PolicyBenchConfig:
    # workload "trace": outputs forced to each request's output_tokens with ignore_eos, as vLLM runs them
    return PolicyBenchConfig(max_len=config.max_len, max_num_seqs=config.peers.max_num_seqs,
                             max_num_batched_tokens=config.peers.max_num_batched_tokens,
                             preemption_mode=config.peers.preemption_mode, workload="trace")


def _offline_capacity(model, requests, config: NaturalPeersConfig, kv_cache_bytes: int) -> float:
    at_once = [dataclasses.replace(r, arrival_s=0.0) for r in requests]
    with tqdm(total=len(requests), desc="ours paged_greedy offline (capacity)", unit="req", leave=False) as inner:
        result = run_policy(copy.deepcopy(model), "paged_greedy", at_once, {}, _bench_config(config),
                            kv_cache_bytes, inner)
    return len(requests) / result.wall_s


def _run_ours(model, policy: str, requests, estimates, config: NaturalPeersConfig, kv_cache_bytes: int,
              fraction: float, rate: float, dtype_name: str, probe: LengthProbe | None) -> dict:
    run_probe = None
    if policy == ORACLE:
        policy, label = DEFAULT_POLICY, f"{DEFAULT_POLICY}+oracle"
        estimates = {r.request_id: (r.output_tokens, r.output_tokens) for r in requests}
    elif policy == PROBED:
        policy, label, run_probe = DEFAULT_POLICY, f"{DEFAULT_POLICY}+probe", probe
    else:
        label = policy
    with tqdm(total=len(requests), desc=f"  {label} {fraction:g}x", unit="req", leave=False) as inner:
        result = run_policy(copy.deepcopy(model), policy, requests, estimates, _bench_config(config),
                            kv_cache_bytes, inner, probe=run_probe)
    return _row("ours", label, fraction, rate, result.output_tokens, result.wall_s, result.latency_s,
                result.ttft_s, result.tpot_s, result.num_preemptions, result.outputs_ok, dtype_name) | {
        "probe_reads": result.num_probe_reads}


def _run_vllm(config: NaturalPeersConfig, model_dir: Path, requests, units: list[float], kv_cache_bytes: int,
              dtype: str, vocab_size: int, log_dir: Path | None, runs: list[dict]) -> float:
    """vLLM's offline run and one run per rate (appended to `runs`); its offline capacity in requests/s."""
    online = {"unit_arrivals_s": units, "rate_fractions": list(config.rate_fractions),
              "warmup": {"prompts": warm_up_prompts(vocab_size), "output_tokens": WARMUP_OUTPUT_TOKENS}}
    print(f"vLLM: start-up, warm-up, an offline run, then {len(config.rate_fractions)} online runs (one process)")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="s3serve-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    result = run_vllm(config.peers, model_dir, requests, kv_cache_bytes, log_dir / "vllm-natural.log",
                      config.max_len, online, dtype=dtype)
    print(f"vLLM log: {log_dir / 'vllm-natural.log'}")
    runs.append(_row("vllm", "paged (vLLM)", 0.0, None, result["output_tokens"], result["wall_s"],
                     list(result["latency_s"].values()), list(result["ttft_s"].values()),
                     list(result["tpot_s"].values()), result["preemptions"], result["exact_lengths"], dtype))
    for replay in result["online"]:
        runs.append(_row("vllm", "paged (vLLM)", replay["rate_fraction"], replay["rate_per_s"],
                         replay["output_tokens"], replay["wall_s"], list(replay["latency_s"].values()),
                         list(replay["ttft_s"].values()), list(replay["tpot_s"].values()), replay["preemptions"],
                         replay["exact_lengths"], dtype))
    return result["capacity_requests_per_s"]


def _row(system: str, policy: str, fraction: float, rate: float | None, output_tokens: int, wall_s: float,
         latency_s: list[float], ttft_s: list[float], tpot_s: list[float], preemptions: int, exact: bool,
         dtype_name: str) -> dict:
    return {"system": system, "policy": policy, "rate": fraction, "rate_requests_per_s": rate,
            "tokens_per_s": output_tokens / wall_s, "output_tokens": output_tokens, "wall_s": wall_s,
            "latency_mean_s": sum(latency_s) / len(latency_s), "latency_p50_s": percentile(latency_s, 0.5),
            "latency_p99_s": percentile(latency_s, 0.99), "ttft_p50_s": percentile(ttft_s, 0.5),
            "ttft_p99_s": percentile(ttft_s, 0.99), "tpot_mean_s": sum(tpot_s) / len(tpot_s) if tpot_s else None,
            "preemptions": preemptions, "exact_lengths": exact, "dtype": dtype_name}


def _report(config: NaturalPeersConfig, runs: list[dict], info: dict, capacity_per_s: float | None,
            json_path: Path | None) -> dict:
    headers = ["system", "policy", "rate_x", "req/s", "tok/s", "lat_mean", "lat_p50", "lat_p99", "ttft_p50",
               "ttft_p99", "tpot_mean", "preempt", "exact"]
    print(format_table(headers, [[r["system"], r["policy"], "offline" if r["rate"] == 0 else r["rate"],
                                  "t=0" if r["rate_requests_per_s"] is None else r["rate_requests_per_s"],
                                  r["tokens_per_s"], r["latency_mean_s"], r["latency_p50_s"], r["latency_p99_s"],
                                  r["ttft_p50_s"], r["ttft_p99_s"], r["tpot_mean_s"], r["preemptions"],
                                  r["exact_lengths"]] for r in runs]))
    headline = service_default(tuple(config.policies))
    ratios: dict = {"policy": headline, "by_policy": {}}
    ratio_rows = []
    for fraction in config.rate_fractions:
        peer = next((r for r in runs if r["system"] == "vllm" and r["rate"] == fraction), None)
        for ours in (r for r in runs if r["system"] == "ours" and r["rate"] == fraction and peer):
            values = {name: ours[key] / peer[key] for name, key in (
                ("latency_mean_vs_vllm", "latency_mean_s"), ("latency_p99_vs_vllm", "latency_p99_s"),
                ("ttft_p50_vs_vllm", "ttft_p50_s"), ("tokens_per_s_vs_vllm", "tokens_per_s"))}
            for name, value in values.items():
                ratios["by_policy"].setdefault(ours["policy"], {}).setdefault(name, {})[str(fraction)] = value
                if ours["policy"] == headline:
                    ratios.setdefault(name, {})[str(fraction)] = value
            ratio_rows.append([fraction, ours["policy"], *values.values()])
    if ratio_rows:
        print(format_table(["rate_x", "our policy", "lat_mean/vllm", "lat_p99/vllm", "ttft_p50/vllm",
                            "tok/s / vllm"], ratio_rows))
    probed = " (+probe: re-predicted from hidden states as it decodes)" if PROBED in config.policies else ""
    print(f"same KV for every engine: {config.kv_tokens} tokens; every engine preempts by recompute and warms up "
          f"with the same {len(warm_up_prompts(2))} requests; our {DEFAULT_POLICY} predicts with "
          f"{config.predictor!r}{probed}; {DEFAULT_POLICY}+oracle plans by the true lengths instead (the ceiling); "
          f"the headline ratios are {headline}'s, the service's default; one timed run each")
    if any(r["system"] == "ours" and r["dtype"] != "bfloat16" for r in runs):
        print("our engine and vLLM ran in float32 here (no bf16 instructions): the same KV tokens, twice the bytes")
    result = {"benchmark": "peers", "workload": {"name": "natural", **info, "num_requests": config.num_requests,
                                                 "max_len": config.max_len, "arrivals": "Poisson",
                                                 "seed": config.peers.seed},
              "capacity_requests_per_s": capacity_per_s, "kv_tokens": config.kv_tokens,
              "predictor": config.predictor, "runs": runs, "ratios": ratios, "environment": environment()}
    write_json(json_path, result)
    return result
