"""Read prompt files into chat messages.

Understands the files in `../shared/data/prompts` and generic JSONL:

| format                                  | prompt built from                       |
|-----------------------------------------|-----------------------------------------|
| {"prompt": ...}                         | the prompt                              |
| {"messages": [...]}                     | the messages up to the first user turn  |
| {"instruction", "instances": [{input}]} | instruction + first instance's input    |
| {"instruction", "input"}                | instruction + input                     |
| {"turns": [...]}                        | the first turn                          |
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from benchmarks.jsonl import jsonl_records
from predictor_service.length_example import join_messages

DEFAULT_PROMPTS = Path("../shared/data/prompts/pool.jsonl")


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One prompt as chat messages, with an id stable across runs."""

    prompt_id: str
    messages: tuple[dict, ...]

    @property
    def text(self) -> str:
        """The message contents joined: what a text-reading length predictor trains on and reads."""
        return join_messages(self.messages)


def _join(instruction: str, extra: str | None) -> str:
    extra = (extra or "").strip()
    return f"{instruction.strip()}\n\n{extra}" if extra else instruction.strip()


def _messages(row: dict) -> list[dict] | None:
    if isinstance(row.get("messages"), list):
        messages = []
        for message in row["messages"]:
            messages.append({"role": message["role"], "content": message["content"]})
            if message["role"] == "user":
                return messages
        return None
    if isinstance(row.get("prompt"), str) and "instruction" not in row:
        text = row["prompt"]
    elif isinstance(row.get("instruction"), str):
        instances = row.get("instances") or []
        extra = row.get("input") if "input" in row else (instances[0].get("input") if instances else None)
        text = _join(row["instruction"], extra)
    elif isinstance(row.get("turns"), list) and row["turns"]:
        text = row["turns"][0]
    else:
        return None
    return [{"role": "user", "content": text}] if text.strip() else None


def read_prompts(path: Path | str) -> list[PromptRecord]:
    """Every usable prompt in a JSONL file; raise ValueError naming the file if none is."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    records = []
    for _, row in jsonl_records(path):
        messages = _messages(row)
        if messages is None:
            continue
        native_id = row.get("id", row.get("question_id"))
        if native_id is None:
            digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
            native_id = digest
        records.append(PromptRecord(f"{path.stem}:{native_id}", tuple(messages)))
    if not records:
        raise ValueError(f"{path} holds no prompt in a known format (prompt, messages, instruction, turns)")
    return records


def spread_sample(records: list[PromptRecord], num_prompts: int) -> list[PromptRecord]:
    """Pick `num_prompts` records evenly across the file (pool files are grouped by source set)."""
    if num_prompts >= len(records):
        return list(records)
    stride = len(records) / num_prompts
    return [records[int(i * stride)] for i in range(num_prompts)]


def encode_chat(tokenizer, record: PromptRecord, max_prompt_tokens: int | None = None) -> list[int] | None:
    """Token ids of the chat-templated prompt (for a base model without a chat template, the messages' text as a
    plain prompt); None when longer than `max_prompt_tokens`."""
    # here: the CLI imports this module, and --help must not load torch
    from workers.engine.models import chat_token_ids

    if getattr(tokenizer, "chat_template", None):
        ids = chat_token_ids(tokenizer, record.messages)
    else:
        ids = list(tokenizer(record.text)["input_ids"])
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        return None
    return ids
