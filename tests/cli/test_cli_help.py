"""`s3serve --help` and every subcommand's: each option explained; bad arguments are one line plus a hint."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from s3serve_cli.main import build_parser, main

S3SERVE = Path(sys.executable).parent / "s3serve"


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(argv prefix, parser) of the top level and of every subcommand, nested ones included."""
    yield prefix, parser
    for action in parser._actions:  # argparse has no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, prefix + (name,))


COMMANDS = [prefix for prefix, _ in _commands(build_parser())]


def test_every_subcommand_is_found():
    assert {" ".join(c) for c in COMMANDS} >= {"", "serve", "label", "train-predictor", "bench", "bench engine",
                                                "bench policies", "bench cluster", "bench predictor"}


@pytest.mark.parametrize("prefix", COMMANDS, ids=lambda c: " ".join(c) or "s3serve")
def test_help_exits_0_and_every_option_is_explained(prefix, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*prefix, "--help"])
    assert exit_info.value.code == 0
    assert "usage: s3serve" in capsys.readouterr().out
    parser = dict(_commands(build_parser()))[prefix]
    assert parser.description or not prefix, f"`s3serve {' '.join(prefix)}` has no description"
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                assert choice.help and choice.help.strip(), f"subcommand {choice.dest} has no help"
        else:
            assert action.help and action.help.strip(), f"{'/'.join(action.option_strings) or action.dest} has no help"


@pytest.mark.parametrize("argv, expected", [
    (["serve", "--port", "eighty"], "s3serve serve: error: argument --port: invalid int value: 'eighty'"),
    (["serve", "--policy", "fastest"], "s3serve serve: error: argument --policy: invalid choice: 'fastest'"),
    (["bench"], "s3serve bench: error: the following arguments are required: BENCHMARK"),
    (["launch"], "s3serve: error: argument COMMAND: invalid choice: 'launch'"),
    (["label", "--out", "x.jsonl"], "s3serve label: error: the following arguments are required: --prompts"),
])
def test_bad_argument_is_one_line_and_a_hint(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 2, captured.err
    assert lines[0].startswith(expected), lines[0]
    assert lines[1].startswith("hint: run `s3serve") and lines[1].endswith("--help` for the options")
    assert captured.out == ""


def test_bad_config_value_is_one_line_naming_each_field(tmp_path, capsys):
    code = main(["serve", "--port", "0", "--kv-cache-memory", "-5", "--data-dir", str(tmp_path)])
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("s3serve serve: error: bad service config: port: ") and "(got 0)" in lines[0]
    assert "kv_cache_memory: " in lines[0] and "got '-5'" in lines[0]
    assert lines[1] == "hint: run `s3serve serve --help` for the options"


def test_missing_input_file_is_one_line_and_a_hint(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    code = main(["label", "--prompts", str(missing), "--out", str(tmp_path / "labels.jsonl")])
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"s3serve label: error: prompt file {missing} does not exist",
                     "hint: run `s3serve label --help` for the options"]


def test_errors_are_reported_where_pydantic_is_not_installed(tmp_path, capsys, monkeypatch):
    """The GPU image has no pydantic; a bench's error must still come out as one line, not an ImportError."""
    monkeypatch.setitem(sys.modules, "pydantic", None)  # `import pydantic` now raises ImportError
    missing = tmp_path / "nope.jsonl"
    code = main(["label", "--prompts", str(missing), "--out", str(tmp_path / "labels.jsonl")])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[0] == f"s3serve label: error: prompt file {missing} does not exist"


def test_installed_script_exits_2_on_a_bad_argument():
    result = subprocess.run([str(S3SERVE), "serve", "--num-workers", "two"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "s3serve serve: error: argument --num-workers: invalid int value: 'two'"
