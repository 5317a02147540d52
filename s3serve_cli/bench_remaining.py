"""`s3serve bench remaining`: its arguments (kept apart from `s3serve_cli.bench`, which holds most others)."""

import argparse
from dataclasses import replace
from pathlib import Path

from s3serve_cli.args import add_model_args


def _bench_remaining(args: argparse.Namespace) -> int:
    from benchmarks import remaining_bench

    config = remaining_bench.quick_config() if args.quick else remaining_bench.RemainingBenchConfig()
    overrides = {name: getattr(args, name) for name in ("num_prompts", "max_len", "length_sigma")
                 if getattr(args, name) is not None}
    remaining_bench.run(replace(config, **overrides), args.model, args.model_cache_dir, args.json)
    return 0


def add_remaining_parser(benches) -> None:
    remaining = benches.add_parser(
        "remaining",
        help="how well the predictor, its length distribution and the loop flag rank the remaining output of "
             "answers still going, at 0, 64 and 256 decoded tokens (Kendall tau)",
        description="Runs held-out pool prompts (never in the shipped predictor's training labels) greedily to the "
                    "model's own stop through one engine and, at 0, 64 and 256 decoded tokens, scores by Kendall "
                    "tau against the true remaining tokens: the shipped predictor's point minus what was decoded; "
                    "the expected remaining output of a log-normal around that point given that the answer is "
                    "still going (what s3_peak ranks by); and the same once answers that repeat themselves are "
                    "taken to run to max_tokens. Per checkpoint and per prompt source, with the loop flag's "
                    "precision.",
    )
    add_model_args(remaining)
    remaining.add_argument("--num-prompts", type=int, default=None,
                           help="held-out prompts (default 96; 48 with --quick)")
    remaining.add_argument("--max-len", type=int, default=None, help="longest sequence (default 512)")
    remaining.add_argument("--length-sigma", type=float, default=None,
                           help="spread of the log-normal around each point (default 1.0, s3_peak's)")
    remaining.add_argument("--quick", action="store_true", help="48 prompts (a few minutes here)")
    remaining.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    remaining.set_defaults(handler=_bench_remaining)
