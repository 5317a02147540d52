"""The S3 paper's kind of workload, from the shared data: instructions and the lengths of their answers.

S3 (NeurIPS 2023) measured its 6.49x on Alpaca: short instructions whose answers
text-davinci-003 wrote. The shared data holds that recipe at small scale: self-instruct's 252
user-oriented instructions with text-davinci-003's answers
(`prompts/text-davinci-003_predictions.jsonl`: `instruction`, `input`, `response`, ...).

Each line becomes a `TraceRow` arriving at t=0, in the served model's tokens:

    context_tokens   = the instruction (a blank line, then its input if any) as one user turn
                       under the chat template, ready for the assistant's answer
    generated_tokens = the response's tokens + 1 (the end-of-turn token that stops it)
"""

from pathlib import Path

from benchmarks.jsonl import jsonl_records
from benchmarks.traces import TraceRow
from workers.engine.models import chat_token_ids

DEFAULT_ANSWERS = Path("../shared/data/prompts/text-davinci-003_predictions.jsonl")
_FIELDS = ("instruction", "input", "response")


def user_turn(instruction: str, task_input: str) -> str:
    """The user's message for an instruction and its (possibly empty) input."""
    return instruction.strip() + (f"\n\n{task_input.strip()}" if task_input.strip() else "")


def read_answer_rows(path: Path | str, tokenizer) -> list[TraceRow]:
    """One row per answered instruction of a JSONL file, measured with `tokenizer`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"answers file {path} not found (expected JSONL with {', '.join(_FIELDS)})")
    rows = []
    for number, record in jsonl_records(path):
        if not isinstance(record, dict) or not all(isinstance(record.get(f), str) for f in _FIELDS):
            raise ValueError(f"{path}:{number}: needs string fields {', '.join(_FIELDS)}")
        prompt_ids = chat_token_ids(tokenizer, [{"role": "user",
                                                 "content": user_turn(record["instruction"], record["input"])}])
        answer_ids = tokenizer(record["response"].strip(), add_special_tokens=False)["input_ids"]
        rows.append(TraceRow(0.0, len(prompt_ids), len(answer_ids) + 1))
    if not rows:
        raise ValueError(f"{path} holds no answered instructions")
    return rows
