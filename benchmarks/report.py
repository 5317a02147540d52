"""Benchmark output: an aligned table on stdout and a JSON file."""

import json
import platform
import time
from pathlib import Path

import torch


def format_table(headers: list[str], rows: list[list]) -> str:
    """Plain-text table; floats get 2 decimals (or 3 significant digits when small)."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text_rows)) if text_rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in text_rows]
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (no interpolation); None for no values. Every bench reports these."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def environment() -> dict:
    """Where the numbers were measured."""
    from workers.engine import cpu_kind
    from workers.engine.runtime import usable_cores

    cpu = cpu_kind.this_cpu()

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cores": usable_cores(),
        "machine": platform.machine(),
        "processor": cpu.model_name or platform.processor(),
        "cpu_kind": cpu.name,
        "cpu_bf16": cpu.has_bf16,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(path: Path | str | None, result: dict) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
