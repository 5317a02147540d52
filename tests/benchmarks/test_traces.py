"""Trace replay on the real Azure and Mooncake traces, with a word-level stand-in tokenizer.

`build_requests` only calls `tokenizer.encode`, so a deterministic word tokenizer
exercises it fully without loading a model.
"""

import csv
import json
import zlib
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks.traces import (CappingReport, TraceRow, build_requests, load_prompt_texts, read_trace,
                               select_sessions)


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD_CSV_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
GOOD_JSONL_ROW = '{"timestamp": 0, "input_length": 100, "output_length": 5}\n'


class WordTokenizer:
    """One id per whitespace-separated word (crc32), the same on every run."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False, "trace prompts must not carry special tokens"
        return [zlib.crc32(word.encode()) % 50_000 for word in text.split()]


@pytest.fixture(scope="module")
def traces(shared_data: Path) -> Path:
    return shared_data / "traces"


@pytest.fixture(scope="module")
def prompt_texts(shared_data: Path) -> list[str]:
    return load_prompt_texts(shared_data / "prompts" / "mt_bench_question.jsonl")


def make_requests(rows, prompt_texts, max_len=1024, max_prompt_tokens=512, **kwargs):
    return build_requests(rows, WordTokenizer(), prompt_texts, max_len, max_prompt_tokens, **kwargs)


def raw_azure(path: Path, num_rows: int) -> list[tuple[datetime, int, int]]:
    with path.open(newline="") as lines:
        reader = csv.reader(lines)
        assert next(reader) == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
        return [(datetime.fromisoformat(t), int(c), int(g)) for t, c, g in list(reader)[:num_rows]]


def assert_starts_at_zero_and_non_decreasing(rows: list[TraceRow]) -> None:
    assert rows[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(rows, rows[1:]))


# --- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"])
def test_azure_first_n_rows_match_the_file(traces: Path, name: str):
    rows = read_trace(traces / name, num_requests=300)
    raw = raw_azure(traces / name, 300)

    assert len(rows) == 300
    assert_starts_at_zero_and_non_decreasing(rows)
    assert [(r.context_tokens, r.generated_tokens) for r in rows] == [(c, g) for _, c, g in raw]
    for row, (stamp, _, _) in zip(rows, raw):
        assert row.arrival_s == pytest.approx((stamp - raw[0][0]).total_seconds(), abs=1e-6)


def test_azure_conv_second_row_arrives_4_3_seconds_later(traces: Path):
    # 18:15:50.9951690 - 18:15:46.6805900
    rows = read_trace(traces / "AzureLLMInferenceTrace_conv.csv", num_requests=2)
    assert rows[1] == TraceRow(pytest.approx(4.314579, abs=1e-6), 396, 109)


def test_whole_azure_code_trace(traces: Path):
    rows = read_trace(str(traces / "AzureLLMInferenceTrace_code.csv"))
    assert len(rows) == 8819  # SOURCES.md
    assert_starts_at_zero_and_non_decreasing(rows)
    assert 3000 < rows[-1].arrival_s < 3700  # one hour of traffic
    assert max(r.generated_tokens for r in rows) == 1899


def test_mooncake_milliseconds_become_seconds(traces: Path):
    path = traces / "mooncake_synthetic_trace.jsonl"
    rows = read_trace(path, num_requests=500)
    with path.open() as lines:
        raw = [json.loads(line) for line, _ in zip(lines, range(500))]

    assert len(rows) == 500
    assert_starts_at_zero_and_non_decreasing(rows)
    assert rows[-1].arrival_s > 0
    for row, record in zip(rows, raw):
        assert row.arrival_s == pytest.approx((record["timestamp"] - raw[0]["timestamp"]) / 1000)
        assert (row.context_tokens, row.generated_tokens) == (record["input_length"], record["output_length"])


def test_num_requests_beyond_the_file_returns_every_row(tmp_path: Path):
    path = tmp_path / "small.csv"
    path.write_text(HEADER + "2023-11-16 18:15:46.68,10,5\n2023-11-16 18:15:47.18,20,6\n")
    rows = read_trace(path, num_requests=100)
    assert rows == [TraceRow(0.0, 10, 5), TraceRow(pytest.approx(0.5), 20, 6)]


def test_format_is_detected_from_content_without_a_known_extension(tmp_path: Path):
    jsonl = tmp_path / "trace.log"
    jsonl.write_text(
        '{"timestamp": 1000, "input_length": 7, "output_length": 3}\n'
        '{"timestamp": 3500, "input_length": 8, "output_length": 2}\n'
    )
    table = tmp_path / "trace.txt"
    table.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Extra\n2023-11-16 18:15:46,4,2,x\n")
    assert read_trace(jsonl) == [TraceRow(0.0, 7, 3), TraceRow(2.5, 8, 2)]
    assert read_trace(table) == [TraceRow(0.0, 4, 2)]


# --- malformed input -----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("suffix", "text", "line_no", "says"),
    [
        (".csv", HEADER + GOOD_CSV_ROW + "2023-11-16 18:15:47,abc,44\n", 3, "ContextTokens"),
        (".csv", HEADER + GOOD_CSV_ROW + "2023-11-16 18:15:47,12,-1\n", 3, "GeneratedTokens"),
        (".csv", HEADER + GOOD_CSV_ROW + "yesterday,12,3\n", 3, "TIMESTAMP"),
        (".csv", HEADER + GOOD_CSV_ROW + GOOD_CSV_ROW + "2023-11-16 18:15:47,12\n", 4, "fields"),
        (".csv", "time,prompt,output\n" + GOOD_CSV_ROW, 1, "ContextTokens"),
        (".csv", HEADER + "2023-11-16 18:15:47,1,1\n" + GOOD_CSV_ROW, 3, "earlier"),
        (".jsonl", GOOD_JSONL_ROW + "{not json\n", 2, "not JSON"),
        (".jsonl", GOOD_JSONL_ROW + "\n" + '{"timestamp": 5, "input_length": 9}\n', 3, "output_length"),
        (".jsonl", GOOD_JSONL_ROW + '{"timestamp": "soon", "input_length": 9, "output_length": 1}\n', 2, "timestamp"),
        (".jsonl", GOOD_JSONL_ROW + '{"timestamp": 5, "input_length": 9.5, "output_length": 1}\n', 2, "input_length"),
        (".jsonl", GOOD_JSONL_ROW + "[1, 2, 3]\n", 2, "object"),
    ],
)
def test_malformed_rows_name_path_and_line(tmp_path: Path, suffix: str, text: str, line_no: int, says: str):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError, match=says) as error:
        read_trace(path)
    assert f"{path}:{line_no}:" in str(error.value)


def test_missing_and_empty_files(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        read_trace(tmp_path / "nope.csv")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no trace rows"):
        read_trace(empty)
    with pytest.raises(ValueError, match="num_requests must be >= 1 or None, got 0"):
        read_trace(empty, num_requests=0)


# --- building requests ---------------------------------------------------------------------


def test_mooncake_long_prompts_are_capped_to_exact_lengths(traces: Path, prompt_texts: list[str]):
    rows = read_trace(traces / "mooncake_synthetic_trace.jsonl", num_requests=200)
    requests, report = make_requests(rows, prompt_texts, max_len=2048, max_prompt_tokens=1536)

    expected_prompts = [min(row.context_tokens, 1536) for row in rows]
    expected_outputs = [max(1, min(row.generated_tokens, 2048 - p)) for row, p in zip(rows, expected_prompts)]
    assert [len(r.prompt_token_ids) for r in requests] == expected_prompts
    assert [r.output_tokens for r in requests] == expected_outputs
    assert report == CappingReport(
        num_requests=200,
        num_prompt_capped=sum(row.context_tokens > 1536 for row in rows),
        num_output_capped=sum(row.generated_tokens > 2048 - p for row, p in zip(rows, expected_prompts)),
        max_prompt_tokens=1536,
        max_len=2048,
        mean_prompt_tokens=pytest.approx(sum(expected_prompts) / 200),
        mean_output_tokens=pytest.approx(sum(expected_outputs) / 200),
        original_mean_prompt_tokens=pytest.approx(sum(row.context_tokens for row in rows) / 200),
        original_mean_output_tokens=pytest.approx(sum(row.generated_tokens for row in rows) / 200),
    )
    assert 100 < report.num_prompt_capped < 200  # most are tens of thousands of tokens, a few are short
    assert report.original_mean_prompt_tokens > 10_000
    num_capped = sum(row.context_tokens > 1536 or row.generated_tokens > e for row, e in zip(rows, expected_outputs))
    assert sum(r.is_capped for r in requests) == num_capped


def test_azure_conv_outputs_never_exceed_max_len(traces: Path, prompt_texts: list[str]):
    rows = read_trace(traces / "AzureLLMInferenceTrace_conv.csv", num_requests=400)
    requests, report = make_requests(rows, prompt_texts, max_len=256, max_prompt_tokens=128)

    for row, request in zip(rows, requests):
        prompt_len = len(request.prompt_token_ids)
        assert prompt_len == min(row.context_tokens, 128)
        assert 1 <= request.output_tokens == min(row.generated_tokens, 256 - prompt_len)
        assert prompt_len + request.output_tokens <= 256
        assert request.original_context_tokens == row.context_tokens
        assert request.original_generated_tokens == row.generated_tokens
    # With this small context both caps bite on real conversation rows, but not on all of them.
    assert 0 < report.num_prompt_capped < 400
    assert 0 < report.num_output_capped < 400
    assert report.num_output_capped == sum(row.generated_tokens > 256 - min(row.context_tokens, 128) for row in rows)
    assert report.mean_output_tokens < report.original_mean_output_tokens


def test_tiny_rows_still_get_one_prompt_and_one_output_token(prompt_texts: list[str]):
    rows = [TraceRow(0.0, 0, 0), TraceRow(1.0, 3, 1)]
    requests, report = make_requests(rows, prompt_texts, max_len=2, max_prompt_tokens=1)
    assert [(len(r.prompt_token_ids), r.output_tokens) for r in requests] == [(1, 1), (1, 1)]
    assert (report.num_prompt_capped, report.num_output_capped) == (1, 0)
    assert [r.is_capped for r in requests] == [False, True]


def test_offline_arrives_at_once_online_follows_the_scaled_trace(traces: Path, prompt_texts: list[str]):
    rows = read_trace(traces / "AzureLLMInferenceTrace_code.csv", num_requests=100)
    offline, _ = make_requests(rows, prompt_texts)
    online, _ = make_requests(rows, prompt_texts, mode="online")
    compressed, _ = make_requests(rows, prompt_texts, mode="online", time_scale=0.25)

    assert all(r.arrival_s == 0.0 for r in offline)
    assert [r.arrival_s for r in online] == [row.arrival_s for row in rows]
    assert [r.arrival_s for r in compressed] == pytest.approx([row.arrival_s / 4 for row in rows])
    assert compressed[-1].arrival_s > 0
    assert [r.prompt_token_ids for r in offline] == [r.prompt_token_ids for r in online]


def test_prompts_are_real_text_different_and_deterministic(prompt_texts: list[str]):
    tokenizer = WordTokenizer()
    stream = [token for text in prompt_texts for token in tokenizer.encode(text, add_special_tokens=False)]
    rows = [TraceRow(0.0, 40, 10) for _ in range(300)]
    requests, _ = make_requests(rows, prompt_texts)
    again, _ = make_requests(rows, prompt_texts)

    assert requests == again
    assert len({r.prompt_token_ids for r in requests}) == 300
    assert len({r.request_id for r in requests}) == 300
    doubled = stream + stream  # every prompt is a contiguous (cyclic) run of the real token stream
    windows = {tuple(doubled[i : i + 40]) for i in range(len(stream))}
    assert all(r.prompt_token_ids in windows for r in requests)


def test_prompts_longer_than_all_text_cycle_through_it():
    requests, _ = make_requests([TraceRow(0.0, 7, 1)], ["one two three"], max_len=16, max_prompt_tokens=8)
    tokens = WordTokenizer().encode("one two three", add_special_tokens=False)
    assert requests[0].prompt_token_ids == tuple(tokens * 3)[:7]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"max_len": 1, "max_prompt_tokens": 1}, r"max_len must be >= 2 .*got 1"),
        ({"max_len": 64, "max_prompt_tokens": 64}, r"max_prompt_tokens must be in \[1, max_len=64\), got 64"),
        ({"max_len": 64, "max_prompt_tokens": 0}, "got 0"),
        ({"mode": "batch"}, "mode must be one of .*'batch'"),
        ({"mode": "online", "time_scale": 0.0}, "time_scale must be .* got 0.0"),
        ({"prompt_texts": []}, "prompt_texts is empty"),
        ({"prompt_texts": ["   "]}, "tokenize to no tokens"),
        ({"rows": []}, "rows is empty"),
    ],
)
def test_bad_arguments_show_their_values(kwargs: dict, says: str):
    args = {"rows": [TraceRow(0.0, 5, 5)], "prompt_texts": ["some real words"], "max_len": 64, "max_prompt_tokens": 32}
    args.update(kwargs)
    with pytest.raises(ValueError, match=says):
        build_requests(tokenizer=WordTokenizer(), **args)


def test_report_describes_itself_in_one_line(traces: Path, prompt_texts: list[str]):
    rows = read_trace(traces / "mooncake_synthetic_trace.jsonl", num_requests=20)
    _, report = make_requests(rows, prompt_texts, max_len=1024, max_prompt_tokens=768)
    line = report.describe()
    assert "\n" not in line
    assert f"{report.num_requests} requests" in line
    assert "capped at 768 tokens" in line and "max_len 1024" in line
    prompts = f"{report.original_mean_prompt_tokens:.1f} -> {report.mean_prompt_tokens:.1f}"
    outputs = f"{report.original_mean_output_tokens:.1f} -> {report.mean_output_tokens:.1f}"
    assert f"{report.num_prompt_capped} (mean {prompts})" in line
    assert f"{report.num_output_capped} (mean {outputs})" in line


def test_load_prompt_texts_joins_message_contents(shared_data: Path, tmp_path: Path):
    texts = load_prompt_texts(shared_data / "prompts" / "mt_bench_question.jsonl")
    assert len(texts) == 80  # SOURCES.md
    assert all(text.strip() for text in texts)
    chat = tmp_path / "chat.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    assert load_prompt_texts(chat) == ["Be brief.\n\nHi?"]


# --- shared prefixes (Mooncake hash ids) ------------------------------------------------------


def test_mooncake_hash_ids_are_read_and_shared_ids_become_shared_text(traces: Path, prompt_texts: list[str]):
    rows = read_trace(traces / "mooncake_synthetic_trace.jsonl")
    assert all(row.hash_ids for row in rows) and rows[0].hash_ids[:3] == (0, 1, 2)
    sessions = select_sessions(rows, 40)
    assert len(sessions) == 40 and sessions[0].arrival_s == 0.0
    assert [r.arrival_s for r in sessions] == sorted(r.arrival_s for r in sessions)
    assert len({row.hash_ids[0] for row in sessions}) < 10  # a few long conversations, not 40 strangers
    requests, report = make_requests(sessions, prompt_texts, max_len=1024, max_prompt_tokens=256,
                                     tokens_per_hash_id=8)
    assert report.num_prompt_capped == sum(-(-row.context_tokens * 8 // 512) > 256 for row in sessions)
    by_first = {}
    for row, request in zip(sessions, requests):
        assert len(request.prompt_token_ids) == min(-(-row.context_tokens * 8 // 512), 256)
        by_first.setdefault(row.hash_ids[0], []).append((row, request))
    for members in by_first.values():
        (row_a, a), (row_b, b) = members[0], members[-1]
        shared_ids = next((i for i, (x, y) in enumerate(zip(row_a.hash_ids, row_b.hash_ids)) if x != y),
                          min(len(row_a.hash_ids), len(row_b.hash_ids)))
        shared_tokens = min(shared_ids * 8, len(a.prompt_token_ids), len(b.prompt_token_ids))
        assert a.prompt_token_ids[:shared_tokens] == b.prompt_token_ids[:shared_tokens]
    different = [r for r in requests if r.prompt_token_ids[:8] != requests[0].prompt_token_ids[:8]]
    assert different  # other sessions start with other text


def test_rows_without_hash_ids_are_their_own_sessions_and_bad_hash_ids_are_refused(tmp_path: Path):
    rows = [TraceRow(5.0, 10, 2), TraceRow(6.0, 10, 2, (3, 4)), TraceRow(7.0, 10, 2, (3, 9))]
    assert select_sessions(rows, 2) == [TraceRow(0.0, 10, 2, (3, 4)), TraceRow(1.0, 10, 2, (3, 9))]
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: hash_ids must be a list of integers"):
        read_trace(path)
