"""`s3serve label` on the real model: labels are written, resumable, and carry no prompt text."""

import json
from types import SimpleNamespace

import pytest

from s3serve_cli.label import LabelConfig, _sample_seed, read_done
from s3serve_cli.main import main


def cli(capsys, *argv: str) -> SimpleNamespace:
    """`s3serve ARGV` in this process, as `test_calibrate` runs it (a subprocess a call pays torch's import: CI
    time): its exit code and what it printed."""
    code = main(list(argv))
    printed = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=printed.out, stderr=printed.err)


def label(capsys, model_cache_dir, prompts, out, *extra):
    return cli(capsys, "label", "--prompts", str(prompts), "--out", str(out), "--max-len", "96", "--batch-size", "4",
               "--model-cache-dir", str(model_cache_dir), *extra)


@pytest.mark.slow
def test_label_writes_lengths_resumes_and_keeps_prompt_text_out(tmp_path, model_cache_dir, capsys):
    prompts = tmp_path / "prompts.jsonl"
    texts = ["Say hi.", "List three colours.", "Write a haiku about rain."]
    prompts.write_text("\n".join(
        [json.dumps({"prompt": texts[0]}), json.dumps({"messages": [{"role": "user", "content": texts[1]}]}),
         json.dumps({"id": "h", "instruction": texts[2], "input": ""})]) + "\n")
    out = tmp_path / "labels.jsonl"
    first = label(capsys, model_cache_dir, prompts, out, "--limit", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(out.read_text().splitlines()) == 2
    second = label(capsys, model_cache_dir, prompts, out)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "already_labelled: 2" in second.stdout and "to_label: 1" in second.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert f"at_length_limit: {int(rows[2]['finish_reason'] == 'length')}" in second.stdout
    assert len(rows) == 3 and len({r["prompt_id"] for r in rows}) == 3
    assert "prompts:h" in {r["prompt_id"] for r in rows}
    for row in rows:
        assert 1 <= row["output_tokens"] <= 96 - row["prompt_tokens"]
        assert row["finish_reason"] in {"stop", "length"}
        assert row["sampling"]["temperature"] == 0.0
        assert row["sampling"]["max_tokens"] == 96 - row["prompt_tokens"]
    raw = out.read_text()
    assert not any(text in raw for text in texts)


def test_read_done_ignores_a_torn_last_line(tmp_path):
    out = tmp_path / "labels.jsonl"
    out.write_text(json.dumps({"prompt_id": "a", "sample": 0}) + "\n" + '{"prompt_id": "b", "sa')
    assert read_done(out) == {("a", 0)}


def test_read_done_counts_only_rows_made_with_the_same_model_and_settings(tmp_path):
    out = tmp_path / "labels.jsonl"
    rows = [{"prompt_id": "a", "sample": 0, "model": "m", "max_len": 256, "sampling": {"temperature": 0.0}},
            {"prompt_id": "b", "sample": 0, "model": "m", "max_len": 512, "sampling": {"temperature": 0.0}},
            {"prompt_id": "c", "sample": 0, "model": "other", "max_len": 256, "sampling": {"temperature": 0.0}},
            {"prompt_id": "d", "sample": 0, "model": "m", "max_len": 256, "sampling": {"temperature": 0.7}},
            {"prompt_id": "e", "sample": 0, "model": "m", "max_len": 256,
             "sampling": {"temperature": 0.0, "top_p": 0.9}}]
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert read_done(out, "m", 256, 0.0) == {("a", 0), ("e", 0)}
    assert read_done(out, "m", 256, 0.0, 1.0) == {("a", 0)}
    assert read_done(out) == {("a", 0), ("b", 0), ("c", 0), ("d", 0), ("e", 0)}
    sampled = {"prompt_id": "f", "sample": 1, "model": "m", "max_len": 256,
               "sampling": {"temperature": 1.0, "seed": _sample_seed(7, "f", 1)}}
    out.write_text(json.dumps(sampled) + "\n")
    assert read_done(out, "m", 256, 1.0, base_seed=7) == {("f", 1)}
    assert read_done(out, "m", 256, 1.0, base_seed=8) == set()  # another base seed: other draws, labelled again


def test_greedy_labels_refuse_several_samples(tmp_path):
    with pytest.raises(ValueError, match="num_samples > 1 needs a temperature > 0"):
        LabelConfig(prompt_paths=(tmp_path,), out_path=tmp_path / "x", num_samples=3)


@pytest.mark.slow
def test_sampled_labels_give_several_seeded_answers_per_prompt_and_label_stats_reads_them(tmp_path, model_cache_dir,
                                                                                          capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me about the sea."}) + "\n")
    out = tmp_path / "labels.jsonl"
    first = label(capsys, model_cache_dir, prompts, out, "--temperature", "1.0", "--num-samples", "3")
    assert first.returncode == 0, first.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["sample"] for r in rows) == [0, 1, 2]
    assert {r["sampling"]["temperature"] for r in rows} == {1.0}
    assert len({r["sampling"]["seed"] for r in rows}) == 3  # each answer its own draw
    again = label(capsys, model_cache_dir, prompts, out, "--temperature", "1.0", "--num-samples", "3")
    assert "to_label: 0" in again.stdout  # resumed: nothing left
    greedy = label(capsys, model_cache_dir, prompts, out)  # another setting: labelled beside them
    assert greedy.returncode == 0 and "to_label: 1" in greedy.stdout
    stats = cli(capsys, "label-stats", str(out), "--json", str(tmp_path / "stats.json"))
    assert stats.returncode == 0, stats.stderr[-2000:]
    settings = json.loads((tmp_path / "stats.json").read_text())["settings"]
    assert [(s["temperature"], s["num_answers"]) for s in settings] == [(0.0, 1), (1.0, 3)]
    at_limit = sum(r["finish_reason"] == "length" for r in rows) / 3
    assert settings[1]["at_limit_share"] == pytest.approx(at_limit)
