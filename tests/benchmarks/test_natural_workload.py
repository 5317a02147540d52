"""The natural-length workload: held-out prompts, true lengths from labels, the same tokens under every policy."""

import json
import subprocess
import sys

import pytest

from benchmarks.natural_workload import (
    TRAINED_LABELS,
    build_natural_workload,
    choose_held_out,
    compare_outputs,
    natural_load_requests,
    output_digest,
    true_lengths,
)
from predictor_service.training import read_labels

MODEL = "smollm2-135m-instruct"


def test_held_out_prompts_are_none_the_predictor_trained_on_and_the_choice_is_seeded(smollm2_tokenizer, shared_data):
    pool = shared_data / "prompts" / "pool.jsonl"
    chosen, split = choose_held_out(smollm2_tokenizer, 40, 96, seed=3, prompts_path=pool)
    trained = {row.prompt_id for row in read_labels(TRAINED_LABELS)}
    ids = [record.prompt_id for record, _ in chosen]
    assert len(set(ids)) == 40 and not set(ids) & trained
    assert all(len(tokens) <= 96 for _, tokens in chosen)
    assert split.num_trained == len(trained) and split.as_json()["chosen_prompt_ids"] == ids
    assert split.as_json()["num_held_out_prompts"] == split.num_pool - split.num_trained > 40
    again, _ = choose_held_out(smollm2_tokenizer, 40, 96, seed=3, prompts_path=pool)
    other, _ = choose_held_out(smollm2_tokenizer, 40, 96, seed=4, prompts_path=pool)
    assert [r.prompt_id for r, _ in again] == ids != [r.prompt_id for r, _ in other]
    with pytest.raises(ValueError, match="has only"):
        choose_held_out(smollm2_tokenizer, 10, 2, prompts_path=pool)  # no chat prompt is 2 tokens


def _label_row(prompt_id: str, prompt_tokens: int, output_tokens: int, max_len: int, temperature: float = 0.0,
               model: str = MODEL) -> str:
    return json.dumps({"prompt_id": prompt_id, "sample": 0, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                       "sampling": {"max_tokens": max_len - prompt_tokens, "temperature": temperature},
                       "finish_reason": "stop", "model": model, "max_len": max_len})


def test_true_lengths_are_read_only_from_labels_made_with_the_same_prompt_and_settings(smollm2_tokenizer, shared_data,
                                                                                        tmp_path):
    chosen, _ = choose_held_out(smollm2_tokenizer, 4, 96, prompts_path=shared_data / "prompts" / "pool.jsonl")
    (a, a_ids), (b, b_ids), (c, c_ids), (d, d_ids) = chosen
    labels = tmp_path / "labels.jsonl"
    labels.write_text("\n".join([
        _label_row(a.prompt_id, len(a_ids), 17, 256),
        _label_row(b.prompt_id, len(b_ids), 30, 512),  # another max_len
        _label_row(c.prompt_id, len(c_ids), 9, 256, temperature=0.7),  # sampled, not greedy
        _label_row(c.prompt_id, len(c_ids) + 1, 9, 256),  # another prompt rendering
        _label_row(d.prompt_id, len(d_ids), 9, 256, model="another-model"),
    ]) + "\n")
    assert true_lengths(labels, chosen, 256, MODEL) == {a.prompt_id: 17}
    assert true_lengths(tmp_path / "missing.jsonl", chosen, 256, MODEL) == {}


def test_a_workload_without_labels_and_without_a_labeler_is_a_clear_error(smollm2_tokenizer, shared_data, tmp_path):
    with pytest.raises(ValueError, match=f"lacks {MODEL}'s greedy labels at max_len 256 for 2 of the 2 prompts"):
        build_natural_workload(smollm2_tokenizer, MODEL, 2, 256, 96, "offline", 1.0,
                               shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv", tmp_path / "none.jsonl",
                               shared_data / "prompts" / "pool.jsonl")


def test_online_arrivals_follow_the_trace_and_offline_ones_are_zero(smollm2_tokenizer, shared_data, tmp_path):
    pool, trace = shared_data / "prompts" / "pool.jsonl", shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"
    chosen, _ = choose_held_out(smollm2_tokenizer, 4, 96, prompts_path=pool)
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(_label_row(r.prompt_id, len(ids), 5 + i, 256) + "\n" for i, (r, ids) in enumerate(chosen)))
    online = build_natural_workload(smollm2_tokenizer, MODEL, 4, 256, 96, "online", 0.5, trace, labels, pool)
    offline = build_natural_workload(smollm2_tokenizer, MODEL, 4, 256, 96, "offline", 1.0, trace, labels, pool)
    arrivals = [r.arrival_s for r in online.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0 and all(r.arrival_s == 0 for r in offline.requests)
    assert [r.output_tokens for r in online.requests] == [5, 6, 7, 8]
    assert online.describe()["mean_output_tokens"] == 6.5 and online.texts[chosen[0][0].prompt_id]


def test_as_http_requests_the_prompts_go_as_their_chat_messages_and_nothing_is_forced(smollm2_tokenizer,
                                                                                        shared_data):
    from workers.engine.models import chat_token_ids

    pool, trace = shared_data / "prompts" / "pool.jsonl", shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"
    requests, split = natural_load_requests(smollm2_tokenizer, 3, 256, 96, "online", 0.5, trace, pool)
    chosen, _ = choose_held_out(smollm2_tokenizer, 3, 96, prompts_path=pool)
    assert [r.request_id for r in requests] == [record.prompt_id for record, _ in chosen] == list(split.chosen_ids)
    for request, (record, ids) in zip(requests, chosen):
        assert request.forced_output_tokens is None and request.messages == record.messages
        # the router renders the same messages to the same tokens the labels were made from
        assert request.num_prompt_tokens == len(ids) == len(chat_token_ids(smollm2_tokenizer, list(request.messages)))
        assert request.max_tokens == 256 - len(ids)
    arrivals = [r.arrival_s for r in requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    offline, _ = natural_load_requests(smollm2_tokenizer, 3, 256, 96, "offline", 0.5, trace, pool)
    assert [r.arrival_s for r in offline] == [0.0, 0.0, 0.0]


def test_compare_outputs_names_the_requests_whose_tokens_differ():
    same = {"a": output_digest([1, 2, 3]), "b": output_digest([4])}
    assert compare_outputs({"paged_greedy": same, "s3": dict(same)})["identical"]
    report = compare_outputs({"paged_greedy": same, "s3": {**same, "b": output_digest([4, 5])}, "oracle": {"a": same["a"]}})
    assert not report["identical"] and report["reference"] == "paged_greedy"
    assert report["differing"] == {"s3": ["b"], "oracle": ["b"]}


@pytest.mark.slow
def test_bench_policies_natural_workload_labels_first_and_every_policy_gives_the_same_tokens(
        tmp_path, model_cache_dir, shared_data):
    labels, out_json = tmp_path / "labels.jsonl", tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "policies", "--workload", "natural",
         "--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
         "--prompts", str(shared_data / "prompts" / "pool.jsonl"), "--labels", str(labels),
         "--num-requests", "4", "--max-len", "160", "--max-prompt-tokens", "64", "--mode", "online",
         "--time-scale", "0.1", "--predictor", "default",
         "--policies", "max_reserve", "paged_greedy", "sglang_ratio", "s3", "s3_peak", "oracle",
         "--model-cache-dir", str(model_cache_dir), "--json", str(out_json)],
        capture_output=True, text=True, timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "labelling 4 prompts" in result.stdout and "identical under every policy" in result.stdout
    assert len(labels.read_text().splitlines()) == 4  # the true lengths were labelled once, before the runs
    data = json.loads(out_json.read_text())
    assert data["workload"] == "natural" and data["natural"]["identical_tokens"]["identical"]
    assert len(data["natural"]["split"]["chosen_prompt_ids"]) == 4
    assert all(m["all_outputs_exact_length"] for m in data["policies"].values())  # each ended at its labelled length
    assert data["policies"]["oracle"]["preemptions"] == 0
    # the shipped hidden-state probe runs by default with the default model, refining s3's and s3_peak's bounds
    length_aware = ("s3", "s3_peak", "s3+probe", "s3_peak+probe")
    assert all(data["policies"][name]["probe_reads"] >= 4 for name in ("s3+probe", "s3_peak+probe"))
    assert all(data["policies"][name]["probe_reads"] == 0 for name in ("s3", "s3_peak", "paged_greedy"))
    best = data["ratios"]["best_policy"]
    assert best in length_aware and all(data["policies"][best]["tokens_per_s"] >= data["policies"][name]["tokens_per_s"]
                                        for name in length_aware)
    for other in ("max_reserve", "paged_greedy", "sglang_ratio"):
        assert data["ratios"][f"best_vs_{other}"] == pytest.approx(
            data["policies"][best]["tokens_per_s"] / data["policies"][other]["tokens_per_s"])
