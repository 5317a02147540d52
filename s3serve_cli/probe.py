"""`s3serve probe extract` and `s3serve probe train`: the hidden-state probe's data and its training."""

import argparse
from pathlib import Path

from predictor_service.length_predictor import DEFAULT_MAX_LEN
from predictor_service.probe_files import DEFAULT_INTERVAL_TOKENS, DEFAULT_LAST_CHECKPOINT_TOKENS, ProbeConfig
from s3serve_cli.args import add_label_args, add_model_args
from workers.engine.models import DEFAULT_MODEL

#: What `probe train` fits unless told otherwise: the shipped probe's recipe (the pairwise ranking loss on).
RECIPE = ProbeConfig(ranking_weight=1.0)


def feature_jobs(label_paths, prompt_paths, tokenizer, max_len: int, limit: int | None = None) -> tuple[list, dict]:
    """Greedy labels at `max_len` joined to their chat-templated prompts; (jobs, counts of what was left out)."""
    from benchmarks.prompt_pool import encode_chat, read_prompts
    from s3serve_cli.probe_features import FeatureJob
    from predictor_service.training import read_labels

    records = {r.prompt_id: r for path in prompt_paths for r in read_prompts(path)}
    jobs, skipped = [], {"not_greedy_or_other_max_len": 0, "no_prompt": 0, "prompt_tokens_differ": 0}
    seen = set()
    for row in read_labels(label_paths):
        if row.temperature != 0.0 or row.num_prompt_tokens + row.max_tokens != max_len or row.prompt_id in seen:
            skipped["not_greedy_or_other_max_len"] += 1
            continue
        record = records.get(row.prompt_id)
        if record is None:
            skipped["no_prompt"] += 1
            continue
        ids = encode_chat(tokenizer, record)
        if len(ids) != row.num_prompt_tokens:
            skipped["prompt_tokens_differ"] += 1
            continue
        seen.add(row.prompt_id)
        jobs.append(FeatureJob(row.prompt_id, tuple(ids), row.max_tokens, row.num_output_tokens))
        if limit is not None and len(jobs) >= limit:
            break
    return jobs, skipped


def run_extract(label_paths, prompt_paths, out: Path, max_len: int = DEFAULT_MAX_LEN,
                interval_tokens: int = DEFAULT_INTERVAL_TOKENS,
                last_checkpoint_tokens: int = DEFAULT_LAST_CHECKPOINT_TOKENS, limit: int | None = None,
                batch_size: int = 32, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None) -> dict:
    """Record the probe's training rows for every greedy label (fp32, as `s3serve label` runs); write `out` (.npz)."""
    from tqdm import tqdm

    from s3serve_cli.probe_features import extract_hidden_features, report_dict
    from workers.engine.models import load_model, load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(model_name, model_cache_dir)
    jobs, skipped = feature_jobs(label_paths, prompt_paths, load_tokenizer(model_dir), max_len, limit)
    if not jobs:
        raise ValueError(f"no greedy labels at max_len {max_len} with a matching prompt in {label_paths}")
    with tqdm(total=len(jobs), desc="reading hidden states", unit="prompt") as bar:
        features, report = extract_hidden_features(
            load_model(model_dir), jobs, max_len, interval_tokens, last_checkpoint_tokens, max_num_seqs=batch_size,
            on_finished=lambda: bar.update(1))
    features.meta["model"] = model_name
    features.save(out)
    return {"jobs": len(jobs), "skipped": skipped} | report_dict(report)


def run_train(features_path: Path, out: Path, hidden_units: int = RECIPE.hidden_units,
              ranking_weight: float = RECIPE.ranking_weight, quantile: float = RECIPE.quantile,
              interval_tokens: int = RECIPE.interval_tokens, num_epochs: int = RECIPE.num_epochs,
              cap_aware: bool = RECIPE.cap_aware) -> dict:
    """Train the probe on every row of a features file (the bound calibrated on a slice of prompts); save it."""
    from predictor_service.hidden_features import HiddenFeatures
    from predictor_service.hidden_probe import HiddenStateProbe

    features = HiddenFeatures.load(features_path)
    config = ProbeConfig(max_len=int(features.meta["max_len"]), quantile=quantile, hidden_units=hidden_units,
                         ranking_weight=ranking_weight, interval_tokens=interval_tokens, num_epochs=num_epochs,
                         cap_aware=cap_aware)
    probe = HiddenStateProbe(config, features.hidden.shape[1]).fit(features)
    summary = {"rows": len(features), "prompts": len(set(features.prompt_ids.tolist())),
               "calibration": None if probe.calibration is None else probe.calibration.to_dict()}
    probe.save(out, {"trained_on": str(features_path), "model": features.meta.get("model")} | summary)
    return summary


def _extract(args: argparse.Namespace) -> int:
    summary = run_extract(args.labels, args.prompts, args.out, args.max_len, args.interval, args.last_checkpoint,
                          args.limit, args.batch_size, args.model, args.model_cache_dir)
    shown = {k: v for k, v in summary.items() if k != "disagreeing_prompt_ids"}
    print(", ".join(f"{key}: {value}" for key, value in shown.items()) + f" -> {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    summary = run_train(args.features, args.out, args.hidden_units, args.ranking_weight, args.quantile,
                        args.interval, args.epochs, args.cap_aware)
    print(f"probe: {summary['rows']} rows of {summary['prompts']} prompts, bound calibration "
          f"{summary['calibration']} -> {args.out}")
    return 0


def add_probe_parser(commands) -> None:
    probe = commands.add_parser(
        "probe", help="the hidden-state length probe: record its training rows, train it",
        description="The worker-side length predictor reads the served model's final hidden state where the engine "
                    "samples (after the prompt's prefill, then every --interval decoded tokens) and bounds the "
                    "tokens still to come. `extract` records those rows with the engine itself over greedy labels; "
                    "`train` fits the probe on them. `s3serve bench predictor` scores it beside the text predictors.")
    actions = probe.add_subparsers(dest="probe", required=True, metavar="ACTION")
    extract = actions.add_parser(
        "extract", help="run labelled prompts through the engine and record its hidden states (.npz)",
        description="Greedy-runs each labelled prompt (fp32, as `s3serve label` does) to one token past the last "
                    "checkpoint and records the sampled row's hidden state at 0, N, 2N, ... decoded tokens. "
                    "A sequence that stops before the last checkpoint at another length than its label is left "
                    "out and counted (labels made with other settings).")
    add_model_args(extract)
    add_label_args(extract)
    extract.add_argument("--out", type=Path, required=True, help="features file to write (.npz)")
    extract.add_argument("--max-len", type=int, default=DEFAULT_MAX_LEN,
                         help="the labels' max_len (default: %(default)s)")
    extract.add_argument("--interval", type=int, default=DEFAULT_INTERVAL_TOKENS,
                         help="decoded tokens between rows (default: %(default)s)")
    extract.add_argument("--last-checkpoint", type=int, default=DEFAULT_LAST_CHECKPOINT_TOKENS,
                         help="last decoded count recorded; generation stops after it (default: %(default)s)")
    extract.add_argument("--limit", type=int, default=None, help="only the first N labelled prompts")
    extract.add_argument("--batch-size", type=int, default=32, help="sequences running at once (default: %(default)s)")
    extract.set_defaults(handler=_extract)
    train = actions.add_parser("train", help="fit the probe on a features file and save it",
                               description="Fits the probe on every row (a salted-hash slice of prompts is kept "
                                           "for the conformal bound calibration) and writes probe.pt and probe.json.")
    train.add_argument("--features", type=Path, required=True, help="features file from `probe extract`")
    train.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write the probe to")
    train.add_argument("--hidden-units", type=int, default=RECIPE.hidden_units,
                       help="MLP width, 0 for linear (default: %(default)s)")
    train.add_argument("--ranking-weight", type=float, default=RECIPE.ranking_weight,
                       help="weight of the pairwise ranking loss (default: %(default)s)")
    train.add_argument("--quantile", type=float, default=RECIPE.quantile,
                       help="coverage of the bound (default: %(default)s)")
    train.add_argument("--interval", type=int, default=RECIPE.interval_tokens,
                       help="re-predict every N decoded tokens when serving (default: %(default)s)")
    train.add_argument("--epochs", type=int, default=RECIPE.num_epochs, help="training epochs (default: %(default)s)")
    train.add_argument("--cap-aware", action="store_true",
                       help="add a head for the chance of running to max_tokens and point at the expected capped "
                            "remainder (ranks the remaining tokens better once decoding is under way: `bench "
                            "predictor`'s probe_capped row)")
    train.set_defaults(handler=_train)
