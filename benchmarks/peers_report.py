"""`bench peers`' tables and JSON: every run, the single streams, and ours over each peer."""

from pathlib import Path

from benchmarks.report import environment, format_table, write_json
from workers.scheduling.policies import DEFAULT_POLICY


def report(config, runs: list[dict], singles: list[dict], total_tokens: int, log_dir: Path,
            json_path: Path | None) -> dict:
    headers = ["system", "policy", "precision", "kv_gib", "kv_tokens", "tok/s", "preempt", "recomp_tok", "lat_p50",
               "lat_p99", "exact", "host_GB/s"]
    print(format_table(headers, [[r["system"], r["policy"], r["precision"], r["kv_gib"], r["kv_tokens"],
                                  r["tokens_per_s"], "n/a" if r["preemptions"] is None else r["preemptions"],
                                  "n/a" if r["recomputed_tokens"] is None else r["recomputed_tokens"],
                                  r["latency_p50_s"], r["latency_p99_s"], r["exact_lengths"], _host(r)]
                                 for r in runs]))
    if singles:
        print(f"single stream: one request alone ({config.prompt_tokens}-token prompt, "
              f"{config.single_output_tokens} tokens), after each system's first run")
        print(format_table(["system", "precision", "tokens", "tok/s", "ttft_ms", "tpot_ms", "host_GB/s"],
                           [[r["system"], r["precision"], r["output_tokens"], r["tokens_per_s"], r["ttft_ms"],
                             r["tpot_ms"], _host(r)] for r in singles]))
    probes = [gbs for r in runs for gbs in r["host_gbs"]]
    if probes:
        print(f"host_GB/s: this machine's read bandwidth just before and just after each run (a 256 MiB sum, best "
              f"of 3), {min(probes):.1f}-{max(probes):.1f} GB/s in this invocation; every engine here reads its "
              f"weights and KV from that memory, so a run beside a lower figure ran on a busier host")
    ratios = peer_ratios(config, runs, singles)
    ratio_rows = [[key.removeprefix("ours_vs_"), budget, value] for key, by_budget in ratios.items()
                  if key.startswith("ours_vs_") and key != "ours_vs_vllm_policy"
                  for budget, value in by_budget.items()]
    if ratio_rows:
        print(f"ours ({ratios['ours_vs_vllm_policy']}, the service's default) over each peer, same run:")
        print(format_table(["peer", "kv_gib", "ours/peer"], ratio_rows))
        print(f"our engines preempt by {config.preemption_mode} (vLLM V1 and OpenVINO only recompute; llama.cpp "
              f"never preempts: it reserves each slot for the longest request); every engine warmed up before its "
              f"one timed run")
    if any(r["system"] == "ours" and r["dtype"] != "bfloat16" for r in runs):
        fp32_peers = sorted({r["system"] for r in runs if r["precision"] == "fp32" and r["system"] != "ours"})
        also = "".join(f" and {system}" for system in fp32_peers)
        print(f"our engine{also} ran in float32 here (no bf16 instructions): the same KV tokens, twice the bytes")
    print(f"peer logs: {log_dir}")
    result = {
        "benchmark": "peers",
        "workload": {"name": "P8", "num_requests": config.num_requests, "prompt_tokens": config.prompt_tokens,
                     "output_tokens": total_tokens, "max_model_len": config.max_model_len,
                     "predictor": f"noisy-oracle:{config.predictor_sigma}",
                     "single_output_tokens": config.single_output_tokens},
        "runs": runs,
        "single": singles,
        "preemption_mode": config.preemption_mode,
        "ratios": ratios,
        "environment": environment(),
    }
    write_json(json_path, result)
    return result


def _host(row: dict) -> str:
    before, after = row["host_gbs"]
    return f"{before:.1f}/{after:.1f}"


def peer_ratios(config, runs: list[dict], singles: list[dict]) -> dict:
    """Ours over each peer, each of our policies on its own run against the peer's run at the same budget and
    precision: `ours_vs_<peer>` (the service's default policy's, per "<kv_gib>" and "single"), and
    `by_policy.<peer>.<policy>.<kv_gib>`. llama.cpp's Q4_1 rows are the peer "llamacpp_q4_1"."""
    def peer_key(row):
        return row["system"] + ("_q4_1" if row["precision"] == "q4_1" else "")

    by_policy: dict[str, dict[str, dict[str, float]]] = {}
    for peer in (r for r in runs if r["system"] != "ours"):
        for ours in (r for r in runs if r["system"] == "ours" and r["kv_gib"] == peer["kv_gib"]):
            by_policy.setdefault(peer_key(peer), {}).setdefault(ours["policy"], {})[str(float(peer["kv_gib"]))] = (
                ours["tokens_per_s"] / peer["tokens_per_s"])  # "1.0", "0.2", "0.05"
    headline = DEFAULT_POLICY if any(DEFAULT_POLICY in p for p in by_policy.values()) else next(
        (policy for p in by_policy.values() for policy in p), None)
    ratios = {f"ours_vs_{peer}": dict(policies.get(headline, {})) for peer, policies in by_policy.items()}
    ours_single = next((r for r in singles if r["system"] == "ours"), None)
    for peer in (r for r in singles if r["system"] != "ours" and ours_single):
        ratio = ours_single["tokens_per_s"] / peer["tokens_per_s"]
        ratios.setdefault(f"ours_vs_{peer_key(peer)}", {})["single"] = ratio
    ratios.setdefault("ours_vs_vllm", {})
    return {**ratios, "ours_vs_vllm_policy": headline, "by_policy": by_policy}
