"""The records of a JSONL file, one per non-blank line, for the benchmarks' strict readers."""

import json
from collections.abc import Iterator
from pathlib import Path


def jsonl_records(path: Path, encoding: str = "utf-8") -> Iterator[tuple[int, object]]:
    """(line number, parsed value) per non-blank line; a line that is not JSON raises ValueError `path:line: ...`."""
    with path.open(encoding=encoding) as lines:
        for line_no, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_no}: not JSON ({error.msg})") from None
