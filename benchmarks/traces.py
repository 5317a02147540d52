"""Replay real serving traces for scheduler benchmarks.

A trace gives, per request, an arrival time and how many prompt and generated tokens it
had. Replaying it means building one request per row with exactly that much work: a
prompt of real text cut to the row's context length, and an output forced to the row's
generated length (the engine ignores EOS and stops at that count), both capped to the
model's context so every scheduling policy does the same, feasible work.

Formats, detected from the extension (`.csv`; `.jsonl`, `.json`, `.ndjson`), else from
the first non-blank line (`{` means JSONL):

| format                  | arrival                               | prompt tokens | generated tokens |
|-------------------------|---------------------------------------|---------------|------------------|
| Azure LLM inference CSV | TIMESTAMP, date and time (ISO 8601)   | ContextTokens | GeneratedTokens  |
| Mooncake JSONL          | timestamp, milliseconds               | input_length  | output_length    |

Prompts are cut from one token stream made by tokenizing the prompt texts once and
concatenating them, read cyclically; request i starts at offset (i * stride) mod length,
with the stride near the golden ratio of the length and coprime to it, so starts are
distinct and spread out (no shared prefixes for a prefix cache to exploit):

    stream:  [text 0 tokens][text 1 tokens][text 2 tokens] ... [text n tokens] (wraps)
              ^req 0                ^req 2         ^req 1             ^req 3

Shared prefixes (Mooncake's `hash_ids`). Each id names one 512-token block of a prompt
(`MOONCAKE_BLOCK_TOKENS`); rows with the same ids share those blocks' text. With
`tokens_per_hash_id` set, a prompt is built from its ids instead: id h becomes the same
`tokens_per_hash_id` tokens of real text wherever it appears (cut at offset h * stride), so
the replay shares exactly the prefixes the trace shares, scaled by
tokens_per_hash_id / 512 (prompt lengths scale alike, then the prompt cap applies):

    row a: ids [7, 8, 9]     ->  [text@7][text@8][text@9]
    row b: ids [7, 8, 12]    ->  [text@7][text@8][text@12]     (two blocks shared with a)

Mooncake's sharing is mostly between the turns of one conversation, spread over the whole
trace (the first 200 rows share 6% of their blocks; all 3,993 rows share 64%).
`select_sessions` therefore replays whole sessions: rows whose first id is the same (one
conversation, or requests opening with the same system prompt), the largest first, so it
picks the rows that share the most. A prompt cap keeps the first ids, the part a session
shares; outputs keep the trace's lengths (only prompts are scaled).
"""

import csv
import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

from benchmarks.jsonl import jsonl_records
from benchmarks.prompt_pool import read_prompts

REPLAY_MODES = ("offline", "online")
_CSV_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_JSONL_KEYS = ("timestamp", "input_length", "output_length")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
MOONCAKE_BLOCK_TOKENS = 512  # tokens one Mooncake hash id stands for


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One request of a trace, as recorded.

    Attributes:
        arrival_s: seconds since the trace's first row.
        context_tokens: prompt length in the original serving system's tokens.
        generated_tokens: output length in the original serving system's tokens.
        hash_ids: Mooncake's ids of the prompt's blocks (shared ids: shared text); () if the trace has none.
    """

    arrival_s: float
    context_tokens: int
    generated_tokens: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """A request ready to submit: real prompt tokens, an exact output length.

    Attributes:
        request_id: stable id, `trace-<row index>`.
        arrival_s: when to submit, seconds after the replay starts.
        prompt_token_ids: real text, min(context_tokens, max_prompt_tokens) tokens (>= 1).
        output_tokens: tokens to generate, ignoring EOS (>= 1).
        original_context_tokens: the trace row's context length.
        original_generated_tokens: the trace row's generated length.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_tokens: int
    original_context_tokens: int
    original_generated_tokens: int

    @property
    def is_capped(self) -> bool:
        """True when the prompt or the output is shorter than the trace recorded."""
        return (
            len(self.prompt_token_ids) < self.original_context_tokens
            or self.output_tokens < self.original_generated_tokens
        )


@dataclass(frozen=True, slots=True)
class CappingReport:
    """How far the replayed workload departs from the trace; print it with the results.

    Attributes:
        num_requests: requests built.
        num_prompt_capped: prompts cut to max_prompt_tokens.
        num_output_capped: outputs cut to max_len - prompt length.
        max_prompt_tokens: the prompt cap.
        max_len: the cap on prompt + output tokens.
        mean_prompt_tokens: mean replayed prompt length.
        mean_output_tokens: mean replayed output length.
        original_mean_prompt_tokens: mean context length in the trace rows.
        original_mean_output_tokens: mean generated length in the trace rows.
    """

    num_requests: int
    num_prompt_capped: int
    num_output_capped: int
    max_prompt_tokens: int
    max_len: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    original_mean_prompt_tokens: float
    original_mean_output_tokens: float

    def describe(self) -> str:
        """One line for a benchmark's output."""
        return (
            f"{self.num_requests} requests; prompts capped at {self.max_prompt_tokens} tokens: "
            f"{self.num_prompt_capped} (mean {self.original_mean_prompt_tokens:.1f} -> {self.mean_prompt_tokens:.1f}); "
            f"outputs capped at max_len {self.max_len} - prompt: "
            f"{self.num_output_capped} (mean {self.original_mean_output_tokens:.1f} -> {self.mean_output_tokens:.1f})"
        )


def _is_jsonl(path: Path) -> bool:
    if path.suffix.lower() == ".csv":
        return False
    if path.suffix.lower() in _JSONL_SUFFIXES:
        return True
    with path.open(encoding="utf-8-sig") as lines:
        for line in lines:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def _count(value, where: str, name: str) -> int:
    """A non-negative token count from a CSV string or a JSON number."""
    if isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be a token count, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    try:
        count = int(value) if isinstance(value, (int, str)) else None
    except ValueError:
        count = None
    if count is None or count < 0:
        raise ValueError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return count


def _read_csv(path: Path, num_requests: int | None) -> list[tuple[str, float, int, int, tuple[int, ...]]]:
    """(where, timestamp_s relative to the first row, context, generated) per row."""
    rows = []
    first: datetime | None = None
    with path.open(encoding="utf-8-sig", newline="") as lines:
        reader = csv.DictReader(lines)
        missing = [name for name in _CSV_COLUMNS if name not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}:1: header {reader.fieldnames} lacks column(s) {missing}")
        for record in reader:
            where = f"{path}:{reader.line_num}"
            if None in record or any(record[name] is None for name in _CSV_COLUMNS):
                raise ValueError(f"{where}: expected {len(reader.fieldnames)} fields, got a row of another width")
            try:
                stamp = datetime.fromisoformat(record["TIMESTAMP"].strip())
            except ValueError:
                raise ValueError(f"{where}: TIMESTAMP {record['TIMESTAMP']!r} is not a date and time") from None
            if first is None:
                first = stamp
            try:
                offset_s = (stamp - first).total_seconds()
            except TypeError:
                raise ValueError(f"{where}: TIMESTAMP {record['TIMESTAMP']!r} mixes time zones with row 1") from None
            context = _count(record["ContextTokens"].strip(), where, "ContextTokens")
            generated = _count(record["GeneratedTokens"].strip(), where, "GeneratedTokens")
            rows.append((where, offset_s, context, generated, ()))
            if num_requests is not None and len(rows) == num_requests:
                break
    return rows


def _read_jsonl(path: Path, num_requests: int | None) -> list[tuple[str, float, int, int, tuple[int, ...]]]:
    rows = []
    first_ms: float | None = None
    for line_no, record in jsonl_records(path, encoding="utf-8-sig"):
        where = f"{path}:{line_no}"
        if not isinstance(record, dict) or any(key not in record for key in _JSONL_KEYS):
            raise ValueError(f"{where}: expected an object with keys {list(_JSONL_KEYS)}")
        stamp_ms = record["timestamp"]
        if isinstance(stamp_ms, bool) or not isinstance(stamp_ms, (int, float)) or not math.isfinite(stamp_ms):
            raise ValueError(f"{where}: timestamp must be a number of milliseconds, got {stamp_ms!r}")
        first_ms = stamp_ms if first_ms is None else first_ms
        context = _count(record["input_length"], where, "input_length")
        generated = _count(record["output_length"], where, "output_length")
        hash_ids = record.get("hash_ids", [])
        if not isinstance(hash_ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                                                 for h in hash_ids):
            raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
        rows.append((where, (stamp_ms - first_ms) / 1000.0, context, generated, tuple(hash_ids)))
        if num_requests is not None and len(rows) == num_requests:
            break
    return rows


def read_trace(path: Path | str, num_requests: int | None = None) -> list[TraceRow]:
    """The first `num_requests` rows (all when None, or fewer if the file is shorter), in file order.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a malformed row (message names path and line), arrival times going
            backwards, or a file without rows.
    """
    path = Path(path)
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1 or None, got {num_requests}")
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist")
    raw = _read_jsonl(path, num_requests) if _is_jsonl(path) else _read_csv(path, num_requests)
    if not raw:
        raise ValueError(f"{path} holds no trace rows")
    rows = []
    previous_s = 0.0
    for where, arrival_s, context, generated, hash_ids in raw:
        # Replay submits in file order at these times; a step back would be silently reordered.
        if arrival_s < previous_s:
            raise ValueError(f"{where}: arrival {arrival_s:.6f}s is earlier than the row before ({previous_s:.6f}s)")
        previous_s = arrival_s
        rows.append(TraceRow(arrival_s, context, generated, hash_ids))
    return rows


def select_sessions(rows: list[TraceRow], num_requests: int) -> list[TraceRow]:
    """The rows of the largest sessions (same first hash id), in trace order, `num_requests` at most.

    Sessions are taken largest first until they hold `num_requests` rows; arrival times are
    re-based to the first row kept. Rows without hash ids are each their own session.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    sessions: dict[object, list[int]] = {}
    for index, row in enumerate(rows):
        sessions.setdefault(row.hash_ids[0] if row.hash_ids else ("row", index), []).append(index)
    kept: list[int] = []
    for members in sorted(sessions.values(), key=lambda m: (-len(m), m[0])):
        if len(kept) >= num_requests:
            break
        kept += members
    kept = sorted(kept)[:num_requests]
    start_s = rows[kept[0]].arrival_s
    return [replace(rows[i], arrival_s=rows[i].arrival_s - start_s) for i in kept]


def load_prompt_texts(path: Path | str) -> list[str]:
    """One text per prompt record of a prompt JSONL: its message contents joined."""
    return [record.text for record in read_prompts(path)]


def _spread_stride(length: int) -> int:
    """A stride near length / golden ratio and coprime to it: offsets i * stride are distinct mod length."""
    stride = max(1, round(length * 0.6180339887)) if length > 1 else 0
    while math.gcd(stride, length) != 1:
        stride += 1
    return stride


def _cut(stream: list[int], start: int, length: int) -> tuple[int, ...]:
    """`length` tokens of `stream` read cyclically from `start`."""
    tokens: list[int] = []
    while len(tokens) < length:
        tokens.extend(stream[start : start + length - len(tokens)])
        start = 0
    return tuple(tokens)


def _validate(rows, prompt_texts, max_len: int, max_prompt_tokens: int, mode: str, time_scale: float) -> None:
    if not rows:
        raise ValueError("rows is empty: read_trace returned no requests to build")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one prompt and one output token), got {max_len}")
    if not 1 <= max_prompt_tokens < max_len:
        raise ValueError(f"max_prompt_tokens must be in [1, max_len={max_len}), got {max_prompt_tokens}")
    if mode not in REPLAY_MODES:
        raise ValueError(f"mode must be one of {REPLAY_MODES}, got {mode!r}")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a finite number > 0, got {time_scale}")
    if not prompt_texts:
        raise ValueError("prompt_texts is empty: prompts are cut from real text")


def build_requests(
    rows: list[TraceRow],
    tokenizer,
    prompt_texts: list[str],
    max_len: int,
    max_prompt_tokens: int,
    mode: str = "offline",
    time_scale: float = 1.0,
    tokens_per_hash_id: int | None = None,
) -> tuple[list[ReplayRequest], CappingReport]:
    """Requests with the trace's lengths, capped to fit `max_len`, and a report of the capping.

    Args:
        rows: trace rows, from `read_trace`.
        tokenizer: anything with `encode(text, add_special_tokens=False) -> list[int]`.
        prompt_texts: real texts to cut prompts from, from `load_prompt_texts`.
        max_len: cap on prompt + output tokens (the model's context).
        max_prompt_tokens: cap on prompt tokens, below `max_len`.
        mode: "offline" submits everything at 0 s; "online" keeps the trace's arrivals.
        time_scale: multiplies online arrival times (< 1 compresses the trace).
        tokens_per_hash_id: build prompts from the rows' hash ids, each id this many tokens
            (see the module docstring); None cuts them from the stream as usual.
    """
    _validate(rows, prompt_texts, max_len, max_prompt_tokens, mode, time_scale)
    stream = [token for text in prompt_texts for token in tokenizer.encode(text, add_special_tokens=False)]
    if not stream:
        raise ValueError(f"the {len(prompt_texts)} prompt texts tokenize to no tokens")
    stride = _spread_stride(len(stream))
    if tokens_per_hash_id is not None and tokens_per_hash_id < 1:
        raise ValueError(f"tokens_per_hash_id must be >= 1 or None, got {tokens_per_hash_id}")
    requests = []
    wanted_prompt_tokens = []  # the row's length, scaled when built from hash ids: what a cap cuts
    for index, row in enumerate(rows):
        if tokens_per_hash_id is not None and row.hash_ids:
            scaled = -(-row.context_tokens * tokens_per_hash_id // MOONCAKE_BLOCK_TOKENS)
            wanted_prompt_tokens.append(scaled)
            num_prompt = max(1, min(scaled, max_prompt_tokens))
            prompt = [token for h in row.hash_ids[:-(-num_prompt // tokens_per_hash_id)]
                      for token in _cut(stream, (h * stride) % len(stream), tokens_per_hash_id)][:num_prompt]
            num_output = max(1, min(row.generated_tokens, max_len - len(prompt)))
            requests.append(ReplayRequest(f"trace-{index}", row.arrival_s * time_scale if mode == "online" else 0.0,
                                          tuple(prompt), num_output, row.context_tokens, row.generated_tokens))
            continue
        wanted_prompt_tokens.append(row.context_tokens)
        num_prompt = max(1, min(row.context_tokens, max_prompt_tokens))
        num_output = max(1, min(row.generated_tokens, max_len - num_prompt))
        requests.append(
            ReplayRequest(
                request_id=f"trace-{index}",
                arrival_s=row.arrival_s * time_scale if mode == "online" else 0.0,
                prompt_token_ids=_cut(stream, (index * stride) % len(stream), num_prompt),
                output_tokens=num_output,
                original_context_tokens=row.context_tokens,
                original_generated_tokens=row.generated_tokens,
            )
        )
    report = CappingReport(
        num_requests=len(requests),
        num_prompt_capped=sum(len(r.prompt_token_ids) < wanted for r, wanted in zip(requests, wanted_prompt_tokens)),
        num_output_capped=sum(r.output_tokens < r.original_generated_tokens for r in requests),
        max_prompt_tokens=max_prompt_tokens,
        max_len=max_len,
        mean_prompt_tokens=sum(len(r.prompt_token_ids) for r in requests) / len(requests),
        mean_output_tokens=sum(r.output_tokens for r in requests) / len(requests),
        original_mean_prompt_tokens=sum(row.context_tokens for row in rows) / len(rows),
        original_mean_output_tokens=sum(row.generated_tokens for row in rows) / len(rows),
    )
    return requests, report
