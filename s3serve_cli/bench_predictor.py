"""`s3serve bench predictor`: its arguments (kept apart from `s3serve_cli.bench`, which holds the others)."""

import argparse
from pathlib import Path

from predictor_service.kinds import TRAINABLE_KINDS

SHIPPED_FEATURES_HELP = "predictor_service/labels/smollm2-135m-instruct.pool.greedy.hidden.npz"


def _features_beside(label_paths: list[Path]) -> tuple[Path, ...]:
    """The hidden-state rows `s3serve probe extract` made of each labels file, where they lie beside it
    (labels.jsonl -> labels.hidden.npz), as they do for the shipped labels."""
    beside = tuple(path.with_suffix(".hidden.npz") for path in label_paths)
    return tuple(path for path in beside if path.is_file())


def _bench_predictor(args: argparse.Namespace) -> int:
    from benchmarks import predictor_bench, source_folds

    labels = list(args.labels or predictor_bench.DEFAULT_LABELS)
    prompts = list(args.prompts or predictor_bench.DEFAULT_PROMPT_FILES)
    missing = [str(path) for path in (*labels, *prompts) if not Path(path).is_file()]
    if missing:
        raise ValueError(f"no such labels or prompt file: {', '.join(missing)} (pass --labels and --prompts)")
    split = args.split or ("prompt_id" if args.artifact is not None else predictor_bench.LEAVE_SOURCE_OUT)
    features: tuple[Path, ...] = ()
    if not args.no_probe:
        features = tuple(args.probe_features) if args.probe_features else _features_beside(labels)
        if not features:
            print("no probe rows: no hidden-state features lie beside these labels; make them with `s3serve probe "
                  "extract` and pass --probe-features")
    config = predictor_bench.PredictorBenchConfig(
        label_paths=tuple(labels), prompt_paths=tuple(prompts), artifact=args.artifact,
        kinds=None if args.kinds is None else tuple(args.kinds),
        max_len=args.max_len, quantile=args.quantile, use_embedding=not args.no_embedding,
        probe_features=features, split=split,
        **({} if args.min_fold_prompts is None else {"min_fold_prompts": args.min_fold_prompts}),
    )
    if split == predictor_bench.LEAVE_SOURCE_OUT:
        source_folds.run(config, args.json)
    else:
        predictor_bench.run(config, args.json)
    return 0


def add_predictor_parser(benches) -> None:
    predictor = benches.add_parser(
        "predictor",
        help="output-length predictors side by side: mean, prompt-length line, LightGBM, transformer, the "
             "hidden-state probes (and an artifact)",
        description="By default scores every predictor leave-one-source-out, the standard score: each source set "
                    "of the pool is held out in turn and the predictors are trained on the others; prompt sets "
                    "from outside the pool (labels of other prompt files) are never trained on. Per source and "
                    "averaged over sources: Kendall tau-b of the total length at the prefill, 10-bucket "
                    "accuracy, MAE, under-reservation, and tau-b of the remaining length after 64, 128 and 256 "
                    "decoded tokens. --split prompt_id (or source) instead splits once, by a hash of the prompt "
                    "id (the split train-predictor uses) or by three source sets, fits the baselines, LightGBM "
                    "and the transformer on the train side, and reports on the held-out side Kendall tau, "
                    "10-bucket accuracy, MAE, under-reservation rate, mean over-reservation (calibrated and raw "
                    "bound) and latency at batch 1 and 32. With hidden-state features (the served model's own "
                    "states, from `s3serve probe extract`) it trains the probes on the same split and adds their "
                    "rows, and the MAE on the remaining tokens after 64, 128 and 256 decoded tokens, re-predicted "
                    "by the probes. With labels of several temperatures or several samples per prompt (`s3serve "
                    "label --temperature 1.0 --num-samples 4`), a further table scores each temperature apart and "
                    "against each prompt's samples as a distribution: tau and MAE against the prompt's median "
                    "sample, and the mean negative log-likelihood of the samples' length buckets.",
    )
    predictor.add_argument("--labels", type=Path, nargs="+", default=None, metavar="FILE",
                           help="labels JSONL files written by `s3serve label` (default: the shipped ones, "
                                "predictor_service/labels/*.jsonl: the pool's greedy and sampled labels, more greedy "
                                "pool labels that no shipped predictor trained on, and the four instruction sets' "
                                "greedy labels)")
    predictor.add_argument("--prompts", type=Path, nargs="+", default=None, metavar="FILE",
                           help="the prompt JSONL files the labels were made from (default: pool.jsonl and the "
                                "four instruction sets beside it in ../shared/data/prompts)")
    predictor.add_argument("--artifact", type=Path, default=None, metavar="DIR",
                           help="also score this train-predictor artifact (trained on the same labels and split); "
                                "without --kinds only the baselines are trained next to it")
    predictor.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                           choices=TRAINABLE_KINDS,
                           help="predictors to train and score: lightgbm_capped is LightGBM pointing at the "
                                "expected capped length (the chance of running to max_tokens, and the length of "
                                "the answers that stop); the transformer fine-tunes for a few minutes, leave it out "
                                "to be quick (default: mean, linear, lightgbm and transformer; leave-source-out: "
                                "mean, linear, lightgbm, once per fold)")
    predictor.add_argument("--max-len", type=int, default=1024,
                           help="longest sequence; the 10 length buckets span [0, max-len] (default: %(default)s)")
    predictor.add_argument("--quantile", type=float, default=0.9,
                           help="coverage target of the upper bounds (default: %(default)s)")
    predictor.add_argument("--no-embedding", action="store_true",
                           help="train LightGBM without the MiniLM sentence embedding (faster)")
    predictor.add_argument("--split", choices=("leave-source-out", "prompt_id", "source"), default=None,
                           help="leave-source-out (the standard score): hold out each pool source with at least "
                                "--min-fold-prompts labelled prompts in turn, training on the others, and score "
                                "prompt sets from outside the pool (never trained on) with predictors trained on "
                                "the whole pool; a table per source and the averages over sources. prompt_id: hold "
                                "out 20%% of prompts by a hash of the id (train-predictor's split). source: hold "
                                "out gsm8k, arenahard and humaneval at once. Default: leave-source-out, or "
                                "prompt_id with --artifact (an artifact has seen every source)")
    predictor.add_argument("--min-fold-prompts", type=int, default=None, metavar="N",
                           help="leave-source-out holds out a pool source only with N labelled prompts or more; "
                                "smaller ones are always trained on (default: 30)")
    predictor.add_argument("--probe-features", type=Path, nargs="+", default=None, metavar="NPZ",
                           help=f"hidden-state rows for the probes, extracted from these labels (default: the "
                                f"LABELS.hidden.npz beside each labels file, as the shipped "
                                f"{SHIPPED_FEATURES_HELP} lies beside its labels)")
    predictor.add_argument("--no-probe", action="store_true", help="leave the hidden-state probes out")
    predictor.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    predictor.set_defaults(handler=_bench_predictor)
