"""`s3serve calibrate`: a length predictor and a hidden-state probe for any model, from its own answers.

    OUT/labels.jsonl          the model's greedy output lengths on the prompts (appended to: resumable)
    OUT/predictor/vNNNN       the text predictor (`--predictor-artifact OUT/predictor`), its manifest naming the
                              model: of the candidate kinds, the one with the highest leave-one-source-out Kendall tau,
                              as the service's retrainer chooses (`predictor_service.recipe`)
    OUT/probe-features.npz    the engine's hidden states along each labelled answer
    OUT/probe/                the probe (`--length-probe OUT/probe`)

The steps are the commands `label`, `train-predictor` (of the kind the recipe chose), `probe extract` and `probe
train`, with the settings the service's predictors use; `s3serve bench predictor --labels OUT/labels.jsonl
--probe-features OUT/probe-features.npz --split prompt_id` scores both on held-out prompts (its leave-source-out
split, the standard, wants 30 labelled prompts of a source).
"""

import argparse
from pathlib import Path

from benchmarks.prompt_pool import DEFAULT_PROMPTS
from predictor_service.kinds import CANDIDATE_KINDS, REFITTABLE_KINDS
from s3serve_cli.args import add_model_args



def calibrate(model: str, model_cache_dir: Path | None, prompt_paths: tuple[Path, ...], out: Path, max_len: int,
              limit: int | None, batch_size: int, held_out_fraction: float, with_probe: bool,
              kinds: tuple[str, ...] = CANDIDATE_KINDS) -> dict:
    """Run the steps (see the module docstring); returns what each reported."""
    from benchmarks.predictor_bench import load_prompt_texts_by_id, source_of
    from predictor_service.features import FeatureConfig
    from predictor_service.recipe import choose_recipe, holdout_sources
    from predictor_service.training import build_dataset, read_labels, train_predictor
    from s3serve_cli.label import LabelConfig, run_labeling
    from s3serve_cli.probe import run_extract, run_train

    out.mkdir(parents=True, exist_ok=True)
    labels = out / "labels.jsonl"
    print(f"calibrate 1/4: labelling with {model} (greedy, max_len {max_len}) -> {labels}", flush=True)
    report = {"labels": run_labeling(LabelConfig(prompt_paths, labels, max_len=max_len, limit=limit, shuffle=True,
                                                 max_num_seqs=batch_size), model, model_cache_dir)}
    rows = [row for row in read_labels([labels]) if row.model == model and row.num_prompt_tokens + row.max_tokens
            == max_len]
    dataset = build_dataset(rows, load_prompt_texts_by_id(prompt_paths))
    feature_config = FeatureConfig(use_embedding=False)  # hashed n-grams, no sentence embedding (no download)
    sources = holdout_sources(dataset.examples, [source_of(e.prompt_id) for e in dataset.examples],
                              num_hash_dims=feature_config.num_hash_dims)
    print(f"calibrate 2/4: choosing the predictor kind ({', '.join(kinds)}) by Kendall tau on each of "
          f"{len(set(sources))} prompt sources held out in turn", flush=True)
    recipe, scores = choose_recipe(kinds, dataset.examples, dataset.lengths, sources, max_len=max_len,
                                   feature_config=feature_config)
    for score in scores.values():
        print(f"  {score.kind}: leave-source-out tau "
              f"{'n/a (fewer than two sources to hold out)' if score.mean_tau is None else f'{score.mean_tau:.3f}'}",
              flush=True)
    print(f"  fitting {recipe.kind} on {len(rows)} labels -> {out / 'predictor'}", flush=True)
    trained = train_predictor(dataset, recipe.kind, max_len=max_len, feature_config=feature_config,
                              held_out_fraction=held_out_fraction, out_dir=out / "predictor", model=model)
    report["predictor"] = {"artifact": str(trained.artifact_dir), "num_train": trained.num_train,
                           "num_held_out": trained.num_held_out, "held_out": trained.metrics,
                           "recipe": recipe.to_dict(), "candidates": {k: v.to_dict() for k, v in scores.items()}}
    if with_probe:
        features = out / "probe-features.npz"
        print(f"calibrate 3/4: reading the engine's hidden states along each answer -> {features}", flush=True)
        report["probe_features"] = run_extract([labels], prompt_paths, features, max_len, batch_size=batch_size,
                                               model_name=model, model_cache_dir=model_cache_dir)
        print(f"calibrate 4/4: fitting the probe -> {out / 'probe'}", flush=True)
        report["probe"] = run_train(features, out / "probe")
    return report


def _calibrate(args: argparse.Namespace) -> int:
    import json

    out = args.out or Path("calibration") / Path(args.model).name
    report = calibrate(args.model, args.model_cache_dir, tuple(args.prompts), out, args.max_len, args.limit,
                       args.batch_size, args.held_out_fraction, not args.no_probe, tuple(args.kinds))
    (out / "calibration.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    held_out = report["predictor"]["held_out"]
    print(f"{report['predictor']['recipe']['kind']} predictor on {report['predictor']['num_held_out']} held-out "
          "labels: Kendall tau "
          f"{held_out['kendall_tau']:.3f}, bucket accuracy {held_out['bucket_accuracy']:.3f}, MAE "
          f"{held_out['mae_tokens']:.1f} tokens, under-reservation {held_out['under_reservation_rate']:.3f}")
    serve = f"s3serve serve --model {args.model} --predictor-artifact {out / 'predictor'}"
    if not args.no_probe:
        serve += f" --length-probe {out / 'probe'}"
    print(f"serve with it:\n  {serve}\nscore the predictor and the probe on held-out prompts:\n  s3serve bench "
          f"predictor --labels {out / 'labels.jsonl'} --prompts {' '.join(map(str, args.prompts))} --max-len "
          f"{args.max_len} --no-embedding --kinds mean linear lightgbm --split prompt_id" +
          ("" if args.no_probe else f" --probe-features {out / 'probe-features.npz'}"))
    return 0


def add_calibrate_parser(commands) -> None:
    calibrate_parser = commands.add_parser(
        "calibrate",
        help="a length predictor and a hidden-state probe for any model: label prompts with it, train both",
        description="Labels prompts with the model's own greedy answers (resumable: run it again to go on), trains "
                    "the text length predictor (the candidate kind that ranks prompt sources it never saw best; "
                    "held-out metrics printed) and the hidden-state probe on them, and "
                    "writes artifacts that `s3serve serve --predictor-artifact OUT/predictor --length-probe "
                    "OUT/probe` takes. The predictor's manifest names the model; the service warns when it serves "
                    "another.",
    )
    add_model_args(calibrate_parser)
    calibrate_parser.add_argument("--prompts", type=Path, nargs="+", default=[DEFAULT_PROMPTS], metavar="FILE",
                                  help="prompt JSONL files (default: %(default)s)")
    calibrate_parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                                  help="where labels and artifacts go (default: calibration/<model name>)")
    calibrate_parser.add_argument("--max-len", type=int, default=1024,
                                  help="longest sequence; answers run to the model's own stop or to it "
                                       "(default: %(default)s)")
    calibrate_parser.add_argument("--limit", type=int, default=None,
                                  help="label at most N prompts, a seeded shuffle of every set (default: all)")
    calibrate_parser.add_argument("--batch-size", type=int, default=32,
                                  help="sequences the engine runs at once (default: %(default)s)")
    calibrate_parser.add_argument("--held-out-fraction", type=float, default=0.2,
                                  help="share of prompts held out for the predictor's metrics (default: %(default)s)")
    calibrate_parser.add_argument("--kinds", nargs="+", default=list(CANDIDATE_KINDS), choices=REFITTABLE_KINDS,
                                  help="candidate text-predictor kinds; the one with the highest Kendall tau on prompt "
                                       "sources held out in turn (the prompt files' sets, or clusters of the prompts "
                                       "when they name fewer than two) is fitted, as the service's retrainer "
                                       "chooses (default: %(default)s)")
    calibrate_parser.add_argument("--no-probe", action="store_true",
                                  help="train the text predictor only (the probe doubles the engine time)")
    calibrate_parser.set_defaults(handler=_calibrate)
