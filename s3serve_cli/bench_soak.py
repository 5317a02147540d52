"""`s3serve bench soak`: its arguments (kept apart from `s3serve_cli.bench`, which holds most others)."""

import argparse
from dataclasses import replace
from pathlib import Path

from benchmarks.chaos_accounting import SOAK_FAULTS
from s3serve_cli.args import add_model_args, given


def _bench_soak(args: argparse.Namespace) -> int:
    from benchmarks import soak_bench

    base = soak_bench.quick_config() if args.quick else soak_bench.SoakBenchConfig()
    overrides = given((("minutes", args.minutes), ("faults", args.faults),
                       ("load_fraction", args.load_fraction), ("max_tokens", args.max_tokens),
                       ("num_workers", args.workers)))
    soak_bench.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json)
    return 0


def add_soak_parser(benches) -> None:
    soak = benches.add_parser(
        "soak",
        help="the service for N minutes at 80%% of its capacity, with faults: does memory, descriptors, Redis "
             "keys or latency grow?",
        description="Starts the real service (two SmolLM2 workers, the embedded Redis), answers each prompt once "
                    "alone (the text every answer must repeat), measures its capacity (chats sent at once, whole "
                    "answers per second), then sends chats at 80% of it for --minutes from a separate process: "
                    "streamed, whole-body, and streamed ones whose client hangs up after 3 tokens. Faults are "
                    "spread between the end of minute 2 and a minute before the last one. Every 10 s it samples "
                    "the resident memory of every service process, their open file descriptors and Redis's key "
                    "count (all; those without a time to live). Per minute: requests by fate (whole, cancelled, "
                    "refused, lost, corrupted), latency "
                    "p50/p99, memory, descriptors, keys; then the growth from minute 2 to the last.",
    )
    add_model_args(soak)
    soak.add_argument("--minutes", type=float, default=None, help="how long the load runs (default 20; 5 with "
                                                                   "--quick; at least 5)")
    soak.add_argument("--faults", nargs="*", default=None, metavar="FAULT", choices=SOAK_FAULTS,
                      help=f"faults, in order (default: kill_worker kill_redis stop_worker; none with an empty "
                           f"list); from: {' '.join(SOAK_FAULTS)}")
    soak.add_argument("--load-fraction", type=float, default=None,
                      help="the load as a share of the measured capacity (default 0.8)")
    soak.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 32)")
    soak.add_argument("--workers", type=int, default=None, help="worker actors (default 2)")
    soak.add_argument("--quick", action="store_true", help="five minutes of load (about eight in all)")
    soak.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    soak.set_defaults(handler=_bench_soak)
