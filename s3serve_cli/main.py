"""The `s3serve` command line.

Subcommands import their heavy dependencies when they run, so `--help` is fast.
"""

import argparse
import os
import sys
from pathlib import Path

from predictor_service.kinds import TRAINABLE_KINDS
from s3serve_cli.args import add_label_args, add_model_args
from s3serve_cli.bench import add_bench_parser
from s3serve_cli.calibrate import add_calibrate_parser
from s3serve_cli.config_flags import add_config_flags, given_values
from s3serve_cli.probe import add_probe_parser
from s3serve_cli.settings_reference import add_settings_parser


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error plus a hint, instead of the usage block (exit code 2 as before)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\nhint: run `{self.prog} --help` for the options\n")


def _one_line(error: BaseException) -> str:
    """An exception's message on one line (pydantic and others span several). pydantic is looked up, not imported:
    a ValidationError means it is loaded, and the benches run where it is not installed (the GPU image)."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(error, pydantic.ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']} (got {e.get('input')!r})"
                         for e in error.errors())
    return "; ".join(line.strip() for line in str(error).splitlines() if line.strip()) or type(error).__name__


def _label(args: argparse.Namespace) -> int:
    from s3serve_cli.label import LabelConfig, run_labeling

    config = LabelConfig(
        prompt_paths=tuple(args.prompts), out_path=args.out, max_len=args.max_len, temperature=args.temperature,
        top_p=args.top_p, num_samples=args.num_samples, seed=args.seed, limit=args.limit, shuffle=args.shuffle,
        max_num_seqs=args.batch_size,
    )
    summary = run_labeling(config, args.model, args.model_cache_dir)
    print(", ".join(f"{key}: {value}" for key, value in summary.items()) + f" -> {args.out}")
    return 0


def _label_stats(args: argparse.Namespace) -> int:
    from benchmarks.report import format_table, write_json
    from predictor_service.label_stats import setting_stats
    from predictor_service.training import read_labels

    stats = setting_stats(read_labels(args.labels))
    print(format_table(
        ["temp", "top_p", "prompts", "answers", "at_limit", "sometimes_at_limit", "mean_tok", "median_tok",
         "median_range_tok", "explained_by_prompt"],
        [[s.temperature, s.top_p, s.num_prompts, s.num_answers, s.at_limit_share, s.prompts_sometimes_at_limit,
          s.mean_output_tokens, s.median_output_tokens, s.median_prompt_range_tokens, s.explained_by_prompt]
         for s in stats]))
    print("at_limit: answers that ran to max_tokens; sometimes_at_limit: prompts (with several samples) where some "
          "samples did and some did not; explained_by_prompt: share of the variance of log length between prompts "
          "rather than between samples of one prompt (the ceiling for a predictor that sees the prompt only)")
    write_json(args.json, {"labels": [str(path) for path in args.labels], "settings": [s.as_json() for s in stats]})
    return 0


def _train_predictor(args: argparse.Namespace) -> int:
    from benchmarks.predictor_bench import load_prompt_texts_by_id
    from predictor_service.features import FeatureConfig
    from predictor_service.training import build_dataset, labelled_model, read_labels, train_predictor
    from predictor_service.transformer_predictor import TransformerConfig

    print(f"train-predictor: reading labels and prompts, then fitting {args.kind}", flush=True)
    rows = read_labels(args.labels)
    dataset = build_dataset(rows, load_prompt_texts_by_id(args.prompts))
    if dataset.missing_prompt_ids:
        print(f"{len(dataset.missing_prompt_ids)} of {len(rows)} label rows have no prompt in --prompts "
              f"(e.g. {dataset.missing_prompt_ids[0]}); they are left out")
    result = train_predictor(dataset, args.kind, max_len=args.max_len, quantile=args.quantile,
                             feature_config=FeatureConfig(use_embedding=not args.no_embedding),
                             held_out_fraction=args.held_out_fraction, out_dir=args.out,
                             transformer_config=TransformerConfig(num_epochs=args.epochs), fit_all=args.fit_all,
                             model=labelled_model(rows))
    metrics = ", ".join(f"{key}: {value:.3g}" for key, value in result.metrics.items())
    print(f"{args.kind}: {result.num_train} train, {result.num_held_out} held out; {metrics} -> {result.artifact_dir}")
    return 0


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _serve(args: argparse.Namespace) -> int:
    from cluster.config import ServiceConfig, load_config
    from s3serve_cli.serve import run_service

    overrides = given_values(args, ServiceConfig.model_fields)
    try:
        config = load_config(args.config, overrides)
    except Exception as error:  # pydantic's ValidationError lists every bad field
        raise ValueError(f"bad service config: {_one_line(error)}") from None
    return run_service(config, ready_timeout_s=args.start_timeout)


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--config", type=Path, default=None, metavar="YAML",
                       help="YAML file of service settings (the names below with underscores, see "
                            "docs/configuration.md); flags override it")
    serve.add_argument("--start-timeout", type=_positive_seconds, default=900.0, metavar="SECONDS",
                       help="how long start-up may take (Ray, Redis, HTTP proxy, model loading) before giving up "
                            "with the reason; a busy or slow machine needs longer (default: %(default).0f)")
    try:
        from cluster.config import WORKER_SETTING_NAMES, ServiceConfig
    except ImportError as error:  # a machine with the engine only (a GPU image without pydantic) still benches
        serve.description = f"unavailable here: the service needs {error.name}"
        return
    workers = serve.add_argument_group("model and workers", "settings of each worker and its engine "
                                       "(workers/actors/worker_settings.py, workers/scheduling/engine_config.py)")
    add_config_flags(workers, ServiceConfig, WORKER_SETTING_NAMES)
    service = serve.add_argument_group("service", "settings of the router, controller and predictor "
                                                  "(cluster/config.py)")
    add_config_flags(service, ServiceConfig, [n for n in ServiceConfig.model_fields if n not in WORKER_SETTING_NAMES])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="s3serve",
        description="S3 Serve: length-aware LLM serving on Ray. Predicts output lengths, packs requests by "
                    "predicted KV-cache memory, rebalances on misprediction.",
        epilog="examples:\n  s3serve serve --port 8000 --num-workers 2\n"
               "  s3serve label --prompts prompts.jsonl --out labels.jsonl\n"
               "  s3serve train-predictor --labels labels.jsonl --prompts prompts.jsonl --out artifacts/\n"
               "  s3serve calibrate --model gemma3-270m --limit 300\n"
               "  s3serve bench policies --quick\n"
               "Run `s3serve COMMAND --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the HTTP service (OpenAI-compatible API on 127.0.0.1:8000)",
        description="Start a local Ray cluster, Redis, the length predictor, the controller, the workers and the "
                    "HTTP router; print the URL and a curl example once it answers; stop cleanly on Ctrl-C. "
                    "A live status page is at /dashboard, Prometheus metrics at /metrics.")
    _add_serve_args(serve)
    serve.set_defaults(handler=_serve)

    label = commands.add_parser(
        "label",
        help="label prompts with the served model's own output lengths (predictor training data)",
        description="Runs each prompt through the engine with the chat template, greedy or with the given "
                    "sampling settings (--temperature 1.0 is what an OpenAI-API client gets by default), and appends, per prompt and sample, a JSON line with a stable prompt id, "
                    "prompt and output token counts, finish reason and sampling settings (no prompt text). "
                    "Re-running with the same --out resumes.",
    )
    add_model_args(label)
    label.add_argument("--prompts", type=Path, nargs="+", required=True, metavar="FILE",
                       help="prompt JSONL files: the sets in ../shared/data/prompts, or {\"prompt\": ...} / "
                            "{\"messages\": [...]} lines")
    label.add_argument("--out", type=Path, required=True, help="labels JSONL to append to")
    label.add_argument("--max-len", type=int, default=1024,
                       help="longest sequence; max_tokens = max-len minus the prompt (default: %(default)s)")
    label.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s, greedy)")
    label.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: %(default)s)")
    label.add_argument("--num-samples", type=int, default=1,
                       help="samples per prompt, needs --temperature > 0 (default: %(default)s)")
    label.add_argument("--seed", type=int, default=0, help="base seed of sampled labels (default: %(default)s)")
    label.add_argument("--limit", type=int, default=None, help="label only the first N prompts")
    label.add_argument("--shuffle", action="store_true",
                       help="take prompts in a random order seeded by --seed, so a partial run covers every set")
    label.add_argument("--batch-size", type=int, default=32, help="sequences running at once (default: %(default)s)")
    label.set_defaults(handler=_label)

    label_stats = commands.add_parser(
        "label-stats",
        help="what labels say about output lengths: share at the length limit, spread between samples of a prompt",
        description="Reads labels from `s3serve label` and prints, per sampling setting: prompts, answers, the "
                    "share of answers that ran to max_tokens, and for prompts sampled several times how often only "
                    "some samples hit the limit, the median spread in tokens, and the share of the variance of log "
                    "length that the prompt explains.",
    )
    label_stats.add_argument("labels", type=Path, nargs="+", metavar="LABELS", help="labels JSONL files")
    label_stats.add_argument("--json", type=Path, default=None, help="also write the table to this JSON file")
    label_stats.set_defaults(handler=_label_stats)

    train = commands.add_parser(
        "train-predictor",
        help="train an output-length predictor on labels from `s3serve label` and save a versioned artifact",
        description="Joins label rows to prompt text by prompt id, splits prompts into train and held-out by a "
                    "hash of the id, fits the predictor, scores it on the held-out prompts and writes the next "
                    "version under --out (OUT/vNNNN, with OUT/LATEST pointing at it).",
    )
    add_label_args(train)
    train.add_argument("--kind", choices=TRAINABLE_KINDS,
                       default="lightgbm",
                       help="lightgbm over prompt features (lightgbm_capped: its point is the expected capped "
                            "length, from the chance of running to max_tokens), transformer (MiniLM fine-tuned on "
                            "CPU, a few minutes), or a baseline: training mean, line in prompt length (default: "
                            "%(default)s)")
    train.add_argument("--out", type=Path, required=True, metavar="DIR", help="artifact root to add a version to")
    train.add_argument("--quantile", type=float, default=0.9,
                       help="probability that the true length stays within the upper bound (default: %(default)s)")
    train.add_argument("--max-len", type=int, default=1024,
                       help="longest sequence; the 10 length buckets span [0, max-len] (default: %(default)s)")
    train.add_argument("--held-out-fraction", type=float, default=0.2,
                       help="share of prompts held out for the reported metrics (default: %(default)s)")
    train.add_argument("--no-embedding", action="store_true",
                       help="leave out the MiniLM sentence embedding (faster; lightgbm only)")
    train.add_argument("--epochs", type=int, default=4,
                       help="fine-tuning epochs (transformer only) (default: %(default)s)")
    train.add_argument("--fit-all", action="store_true",
                       help="after scoring on the held-out split, refit on every label and save that model")
    train.set_defaults(handler=_train_predictor)

    add_settings_parser(commands)
    add_probe_parser(commands)
    add_calibrate_parser(commands)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    command = " ".join(part for part in ("s3serve", args.command, getattr(args, "bench", None),
                                            getattr(args, "probe", None)) if part)
    if args.command in ("bench", "label", "probe", "calibrate"):
        from workers.engine.runtime import tune_cpu_runtime

        tune_cpu_runtime()  # these run engines in this process
    from cluster.start_error import ServiceStartError

    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, TimeoutError, ServiceStartError) as error:
        print(f"{command}: error: {_one_line(error)}", file=sys.stderr)
        hint = ("the service's own logs are under /tmp/ray/session_latest/logs"
                if isinstance(error, (TimeoutError, ServiceStartError))
                else f"run `{command} --help` for the options")
        print(f"hint: {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
