"""`s3serve bench coldstart`: its arguments (kept apart from `s3serve_cli.bench`, which holds most others)."""

import argparse
from dataclasses import replace
from pathlib import Path


def _bench_coldstart(args: argparse.Namespace) -> int:
    from benchmarks import coldstart_bench

    config = coldstart_bench.quick_config() if args.quick else coldstart_bench.ColdStartConfig()
    overrides = {name: getattr(args, name) for name in ("num_requests", "max_tokens", "retrain_min_samples",
                                                        "num_workers", "prompts_path")
                 if getattr(args, name) is not None}
    coldstart_bench.run(replace(config, **overrides), args.model, args.model_cache_dir, args.json)
    return 0


def add_coldstart_parser(benches) -> None:
    coldstart = benches.add_parser(
        "coldstart",
        help="a service for a model no predictor was trained for: after how many requests retraining on its own "
             "traffic promotes a learnt predictor, and how it ranks the requests it never saw against the prior",
        description="Starts `s3serve serve` with retraining on, for a model no length-predictor artifact was "
                    "trained for (default: SmolLM2's converted folder given as a path, which the service cannot "
                    "tell from any user's model), sends pool prompts as greedy streamed chats, records each "
                    "retraining attempt, and scores every promoted version on the requests that finished after it "
                    "was trained (Kendall tau, bucket accuracy, MAE, under-reservation) beside the max_tokens prior "
                    "the routers served until then, on the same requests.",
    )
    coldstart.add_argument("--model", default=None,
                           help="a local Hugging Face folder, .gguf file or hub id in the local cache (default: "
                                "SmolLM2's converted folder, as a path)")
    coldstart.add_argument("--model-cache-dir", type=Path, default=None,
                           help="where bundled models are kept once converted (default: ~/.cache/s3serve/models)")
    coldstart.add_argument("--num-requests", type=int, default=None,
                           help="chats sent, each a different pool prompt (default 640; 360 with --quick)")
    coldstart.add_argument("--max-tokens", type=int, default=None,
                           help="each request's max_tokens (default 512; 256 with --quick)")
    coldstart.add_argument("--retrain-min-samples", type=int, default=None,
                           help="finished requests between retraining attempts (default 200, the service's; 120 "
                                "with --quick)")
    coldstart.add_argument("--num-workers", type=int, default=None, help="service workers (default 1)")
    coldstart.add_argument("--prompts", dest="prompts_path", default=None,
                           help="JSONL prompt pool (default ../shared/data/prompts/pool.jsonl)")
    coldstart.add_argument("--quick", action="store_true",
                           help="360 requests of at most 256 tokens, retraining every 120 (about 10 minutes here)")
    coldstart.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    coldstart.set_defaults(handler=_bench_coldstart)
