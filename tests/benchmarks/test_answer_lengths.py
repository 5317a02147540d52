"""The paper workload's rows: instructions and their answers, measured in the served model's tokens."""

import json

import pytest

from benchmarks.answer_lengths import read_answer_rows, user_turn
from workers.engine.models import chat_token_ids


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_rows_hold_the_prompt_under_the_chat_template_and_the_answer_plus_its_stop(tmp_path, smollm2_tokenizer):
    answers = _write(tmp_path / "a.jsonl", [
        {"instruction": "Name a color.", "input": "", "response": " Blue."},
        {"instruction": "Translate to French.", "input": "Good morning, my friend.", "response": "Bonjour, mon ami."},
    ])
    rows = read_answer_rows(answers, smollm2_tokenizer)
    assert [r.arrival_s for r in rows] == [0.0, 0.0]
    assert rows[0].context_tokens == len(chat_token_ids(smollm2_tokenizer, [{"role": "user", "content": "Name a color."}]))
    assert rows[0].generated_tokens == len(smollm2_tokenizer("Blue.", add_special_tokens=False)["input_ids"]) + 1
    with_input = chat_token_ids(smollm2_tokenizer, [{"role": "user", "content": "Translate to French.\n\nGood morning, my friend."}])
    assert rows[1].context_tokens == len(with_input)
    assert user_turn("Do it. ", "  ") == "Do it."


def test_the_shared_answers_are_short_as_in_the_papers_alpaca(shared_data, smollm2_tokenizer):
    rows = read_answer_rows(shared_data / "prompts" / "text-davinci-003_predictions.jsonl", smollm2_tokenizer)
    assert len(rows) == 252
    mean_total = sum(r.context_tokens + r.generated_tokens for r in rows) / len(rows)
    assert 100 < mean_total < 400  # a 2048-token worst-case reservation wastes most of its blocks
    assert min(r.generated_tokens for r in rows) >= 2


@pytest.mark.parametrize("line, message", [
    ("not json", ":2: not JSON"),
    (json.dumps({"instruction": "x", "response": "y"}), ":2: needs string fields instruction, input, response"),
    (json.dumps(["a list"]), ":2: needs string fields"),
])
def test_bad_lines_are_errors_with_their_line_number(tmp_path, smollm2_tokenizer, line, message):
    answers = _write(tmp_path / "a.jsonl", [{"instruction": "a", "input": "", "response": "b"}, line])
    with pytest.raises(ValueError, match=message):
        read_answer_rows(answers, smollm2_tokenizer)


def test_a_missing_or_empty_file_is_a_clear_error(tmp_path, smollm2_tokenizer):
    with pytest.raises(FileNotFoundError, match="answers file .* not found"):
        read_answer_rows(tmp_path / "none.jsonl", smollm2_tokenizer)
    with pytest.raises(ValueError, match="holds no answered instructions"):
        read_answer_rows(_write(tmp_path / "empty.jsonl", ["", "  "]), smollm2_tokenizer)
