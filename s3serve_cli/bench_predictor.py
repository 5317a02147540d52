"""`s3serve bench predictor`: its arguments (kept apart from `s3serve_cli.bench`, which holds the others)."""

import argparse
from pathlib import Path

from s3serve_cli.args import add_label_args

SHIPPED_FEATURES_HELP = "predictor_service/labels/smollm2-135m-instruct.pool.greedy.hidden.npz"


def _bench_predictor(args: argparse.Namespace) -> int:
    from benchmarks import predictor_bench

    features = None if args.no_probe else args.probe_features
    shipped_labels = any(path.resolve() == predictor_bench.SHIPPED_LABELS.resolve() for path in args.labels)
    if features is None and not args.no_probe:
        if shipped_labels and predictor_bench.SHIPPED_FEATURES.is_file():
            features = predictor_bench.SHIPPED_FEATURES  # the hidden states of those very labels
        else:
            print("no probe rows: the shipped hidden-state features belong to the shipped labels; make features "
                  "for these labels with `s3serve probe extract` and pass --probe-features")
    config = predictor_bench.PredictorBenchConfig(
        label_paths=tuple(args.labels), prompt_paths=tuple(args.prompts), artifact=args.artifact,
        kinds=None if args.kinds is None else tuple(args.kinds),
        max_len=args.max_len, quantile=args.quantile, use_embedding=not args.no_embedding,
        probe_features=features, split=args.split,
    )
    predictor_bench.run(config, args.json)
    return 0


def add_predictor_parser(benches) -> None:
    predictor = benches.add_parser(
        "predictor",
        help="output-length predictors side by side: mean, prompt-length line, LightGBM, transformer, the "
             "hidden-state probes (and an artifact)",
        description="Splits the labelled prompts into train and held-out by a hash of the prompt id (the split "
                    "train-predictor uses) or by source set, fits the baselines, LightGBM and the transformer on "
                    "the train side, and reports on the held-out side Kendall tau, 10-bucket accuracy, MAE, "
                    "under-reservation rate, mean over-reservation (calibrated and raw bound) and latency at batch "
                    "1 and 32. With hidden-state features (the served model's own states, from `s3serve probe "
                    "extract`) it trains the probes on the same split and adds their rows, and the MAE on the "
                    "remaining tokens after 64 and 256 decoded tokens, re-predicted by the probes. With labels of "
                    "several temperatures or several samples per prompt (`s3serve label --temperature 1.0 "
                    "--num-samples 4`), a further table scores each temperature apart and against each prompt's "
                    "samples as a distribution: tau and MAE against the prompt's median sample, and the mean "
                    "negative log-likelihood of the samples' length buckets.",
    )
    add_label_args(predictor)
    predictor.add_argument("--artifact", type=Path, default=None, metavar="DIR",
                           help="also score this train-predictor artifact (trained on the same labels and split); "
                                "without --kinds only the baselines are trained next to it")
    predictor.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                           choices=("mean", "linear", "lightgbm", "transformer"),
                           help="predictors to train and score (default: all four; the transformer fine-tunes "
                                "for a few minutes, leave it out to be quick)")
    predictor.add_argument("--max-len", type=int, default=1024,
                           help="longest sequence; the 10 length buckets span [0, max-len] (default: %(default)s)")
    predictor.add_argument("--quantile", type=float, default=0.9,
                           help="coverage target of the upper bounds (default: %(default)s)")
    predictor.add_argument("--no-embedding", action="store_true",
                           help="train LightGBM without the MiniLM sentence embedding (faster)")
    predictor.add_argument("--split", choices=("prompt_id", "source"), default="prompt_id",
                           help="prompt_id: hold out 20%% of prompts by a hash of the id; source: hold out whole "
                                "source sets (gsm8k, arenahard, humaneval) never trained on (default: %(default)s)")
    predictor.add_argument("--probe-features", type=Path, default=None, metavar="NPZ",
                           help=f"hidden-state rows for the probes, extracted from these labels (default with the "
                                f"shipped labels: the shipped {SHIPPED_FEATURES_HELP})")
    predictor.add_argument("--no-probe", action="store_true", help="leave the hidden-state probes out")
    predictor.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    predictor.set_defaults(handler=_bench_predictor)
