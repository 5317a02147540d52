"""`s3serve bench cluster`: its arguments (kept apart from `s3serve_cli.bench`, which holds most others)."""

import argparse
from pathlib import Path

from benchmarks.prompt_pool import DEFAULT_PROMPTS
from cluster.control.routing import DEFAULT_ROUTING, ROUTINGS
from s3serve_cli.args import add_model_args, add_rebalance_arg, given


def _bench_cluster(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from benchmarks import cluster_bench, cluster_bench_config

    base = cluster_bench_config.quick_config() if args.quick else cluster_bench_config.ClusterBenchConfig()
    overrides = {"trace_path": args.trace, "prompts_path": args.prompts, "max_len": args.max_len,
                 "concurrency": args.concurrency, "workload": args.workload, "probe": args.probe}
    if args.workload == "natural" and args.predictor is None:
        overrides["predictor"] = "default"  # the forced lengths a noisy oracle reads do not exist here
    overrides |= given((("num_workers", args.workers), ("num_requests", args.num_requests),
                        ("time_scale", args.time_scale), ("kv_cache_bytes", args.kv_cache_bytes),
                        ("max_prompt_tokens", args.max_prompt_tokens), ("predictor", args.predictor),
                        ("urgent_share", args.urgent_share), ("rebalance_min_gap", args.rebalance_min_gap),
                        ("dtype", args.dtype), ("policies", args.policy), ("routings", args.routing)))
    cluster_bench.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json)
    return 0


def add_cluster_parser(benches) -> None:
    cluster = benches.add_parser(
        "cluster",
        help="the whole service over HTTP, s3 vs max_reserve (vs paged_greedy): throughput, latency, balance",
        description="For each policy in turn: starts the service (local Ray, embedded Redis, N workers, the same "
                    "per-worker KV budget), replays the trace over HTTP from a separate client process (streamed "
                    "completions at the trace's arrival times, real prompt text cut to the trace's context length, "
                    "output length forced to the trace's, max_tokens = max-len minus the prompt) and stops it. "
                    "Reports completed/failed requests, tokens/s, req/s, TTFT and latency p50/p99 (client side), "
                    "per-worker balance (min/max generated tokens), migrations, requeues, preemptions, overruns, "
                    "router+predictor+placement overhead p50/p99 and s3's throughput ratios. With --workload natural "
                    "the model stops on its own instead, and the table adds whether every policy gave the same "
                    "answers.",
    )
    add_model_args(cluster)
    cluster.add_argument("--workers", type=int, default=None, help="worker actors per service (default 2)")
    cluster.add_argument("--policy", nargs="+", default=None, metavar="POLICY",
                         help="policies to run, in order: s3 s3_peak sglang_ratio max_reserve paged_greedy, and "
                              "with --workload natural also s3+probe s3_peak+probe (the workers' hidden-state "
                              "probe on, see --probe); any of them followed by /late runs it with the "
                              "service's --late-binding on (a request waits in the controller's queue until a "
                              "worker can start it) "
                              "(default: s3 max_reserve)")
    cluster.add_argument("--routing", nargs="+", default=None, choices=ROUTINGS, metavar="ROUTING",
                         help="the services' routing; with several, every policy runs once with each (reported as "
                              "POLICY@ROUTING): predicted_work, room or least_requests "
                              f"(default: {DEFAULT_ROUTING})")
    cluster.add_argument("--workload", choices=("trace", "natural"), default="trace",
                         help="trace: replay --trace with its output lengths forced; natural: held-out pool prompts "
                              "as chat messages, greedy to the model's own stop, arrivals from --trace (or t=0), "
                              "answers compared across policies, --predictor default unless set "
                              "(default: %(default)s)")
    cluster.add_argument("--probe", default="default", metavar="DIR",
                         help="the hidden-state probe of the +probe policies: 'default' (the shipped one, "
                              "SmolLM2-135M) or a folder from `s3serve probe train` (default: %(default)s)")
    cluster.add_argument("--trace", type=Path, default=Path("../shared/data/traces/AzureLLMInferenceTrace_conv.csv"),
                         help="Azure CSV or Mooncake JSONL trace (default: %(default)s)")
    cluster.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                         help="prompt texts the replayed prompts are cut from (default: %(default)s)")
    cluster.add_argument("--num-requests", type=int, default=None,
                         help="first N trace rows, or N prompts with --workload natural (default 64; 32 with "
                              "--quick)")
    cluster.add_argument("--time-scale", type=float, default=None,
                         help="multiply the trace's arrival times by this (<1 compresses); 0 sends every request "
                              "at t=0 (offline) (default 1; 0 with --quick)")
    cluster.add_argument("--max-len", type=int, default=1024,
                         help="the service's context; each request's max_tokens is max-len minus its prompt "
                              "(default: %(default)s)")
    cluster.add_argument("--max-prompt-tokens", type=int, default=None,
                         help="cap on replayed prompt length, reported (default 256; 128 with --quick)")
    cluster.add_argument("--kv-cache-bytes", type=int, default=None,
                         help="KV budget of each worker in bytes (default 188743680: 256 SmolLM2 blocks, room for 4 "
                              "worst-case 1024-token sequences, so memory binds)")
    cluster.add_argument("--predictor", default=None, metavar="SPEC",
                         help="noisy-oracle:SIGMA (default noisy-oracle:0.3: the trace's true lengths with seeded "
                              "log-normal error, served as a lookup artifact, since replayed prompt text says "
                              "nothing about forced lengths; 'default' with --workload natural), 'default' (the "
                              "shipped predictor), or an artifact dir")
    cluster.add_argument("--urgent-share", type=float, default=None, metavar="SHARE",
                         help="send this share of the requests as priority 0 and the rest as priority 5, and report "
                              "TTFT and latency per class (default 0: every request at priority 0)")
    add_rebalance_arg(cluster, "the services'")
    cluster.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                         help="the workers' dtype (default auto: bf16 where the CPU has it; there a greedy answer can "
                              "change with its batch, float32 makes answers comparable token for token)")
    cluster.add_argument("--concurrency", type=int, default=64,
                         help="most requests the client keeps in flight (default: %(default)s)")
    cluster.add_argument("--quick", action="store_true",
                         help="32 requests at t=0, prompts capped at 128 tokens; 2 workers, s3 and max_reserve "
                              "unless set (about 10 min here)")
    cluster.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    cluster.set_defaults(handler=_bench_cluster)
