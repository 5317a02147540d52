"""What `bench chaos` counts: each request's fate, and per fault the requests sent while it was in force.

Pure functions over the load generator's results (`benchmarks.http_load.RequestResult`),
with no service, Ray or Redis, so the accounting is tested on its own.

A request is exactly one of:
    whole       200, the stream ended with [DONE], `usage.completion_tokens` == max_tokens, no error event,
                and its text is the fault-free reference's for the same request (when one is given)
    corrupted   all of that but the text: it differs from the reference (e.g. a stream resumed after a
                failover with wrong or repeated text)
    refused     429 or 503 with `Retry-After` (the service said "not now" and lost nothing)
    duplicated  more tokens than asked for (`usage` above max_tokens, or more text events than tokens)
    truncated   200 whose stream broke off: an error event, no [DONE], or fewer tokens than asked for
    cancelled   the client hung up on purpose, as the plan said (`http_load.CANCELLED`)
    failed      anything else: another status, a refusal without Retry-After, a broken connection
Lost = truncated + failed + duplicated + corrupted: requests whose client got neither the whole, right answer
nor a clean "retry later".
"""

from dataclasses import dataclass

from benchmarks.http_load import CANCELLED

# what `bench chaos` injects, in its default order (`benchmarks.chaos_bench.inject`)
FAULTS = ("kill_worker", "kill_redis", "kill_controller", "stop_worker", "stop_redis", "stop_controller", "kill_router",
          "redis_disk_full", "burst")
# what `bench soak` may inject: not the burst (bench chaos's own load) nor the full disk (it mounts a tmpfs under
# the embedded Redis before the service starts)
SOAK_FAULTS = tuple(name for name in FAULTS if name not in ("burst", "redis_disk_full"))
FATES = ("whole", "refused", "cancelled", "duplicated", "truncated", "corrupted", "failed")
LOST_FATES = ("duplicated", "truncated", "corrupted", "failed")
MAX_LOST_EXAMPLES = 3  # per fault, in the JSON: what the client saw of a lost request


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One fault of the schedule, on the wall clock.

    Attributes:
        name: e.g. "kill_worker" ("none" for the quiet window before the first fault).
        start_unix_s: when it was injected.
        recovery_s: from injection until /health answered 200 and a probe request completed (None: never).
        memory_before_mib, memory_after_mib: the service's resident memory before it and at the end of its window.
    """

    name: str
    start_unix_s: float
    recovery_s: float | None
    memory_before_mib: float
    memory_after_mib: float


def fate(result, max_tokens: int, reference_digest: str | None = None) -> str:
    """Which of `FATES` a request met (see the module docstring); `reference_digest`: the `output_digest` of the
    same request answered without faults (None: the text is not checked)."""
    if result.error == CANCELLED:
        return "cancelled"
    if result.status_code == 200:
        tokens = result.num_completion_tokens
        if (tokens is not None and tokens > max_tokens) or result.num_text_events > max(tokens or 0, max_tokens):
            return "duplicated"
        if result.error is None and result.saw_done and tokens == max_tokens:
            return "whole" if reference_digest in (None, result.output_digest) else "corrupted"
        return "truncated"
    if result.status_code in (429, 503) and result.retry_after_s is not None:
        return "refused"
    return "failed"


def fault_rows(results: list, start_unix_s: float, events: list[FaultEvent], max_tokens: int,
               references: dict[str, str] | None = None) -> list[dict]:
    """Per fault: the requests sent from its injection until the next one's, by fate and by failing status.

    `results[i].sent_s` counts from `start_unix_s`; requests sent before the first event are left out
    (the load was still warming up). `references`: request id -> the fault-free answer's digest.
    """
    ordered = sorted(events, key=lambda e: e.start_unix_s)
    rows = []
    for index, event in enumerate(ordered):
        end_unix_s = ordered[index + 1].start_unix_s if index + 1 < len(ordered) else float("inf")
        window = [r for r in results if event.start_unix_s <= start_unix_s + r.sent_s < end_unix_s]
        rows.append(_row(event, window, max_tokens, references or {}))
    return rows


def _row(event: FaultEvent, window: list, max_tokens: int, references: dict[str, str]) -> dict:
    counts = dict.fromkeys(FATES, 0)
    failed_by_status: dict[str, int] = {}
    lost_examples = []
    for result in window:
        kind = fate(result, max_tokens, references.get(result.request_id))
        counts[kind] += 1
        if kind in LOST_FATES and len(lost_examples) < MAX_LOST_EXAMPLES:
            lost_examples.append({"request_id": result.request_id, "fate": kind, "status": result.status_code,
                                  "tokens": result.num_completion_tokens, "error": result.error})
        if kind in ("refused", "failed"):
            key = str(result.status_code) if result.status_code is not None else "no_response"
            failed_by_status[key] = failed_by_status.get(key, 0) + 1
    return {
        "name": event.name, "sent": len(window), "completed": counts["whole"], "refused": counts["refused"],
        "cancelled": counts["cancelled"],
        "failed": counts["failed"], "failed_by_status": failed_by_status, "duplicated": counts["duplicated"],
        "truncated": counts["truncated"], "corrupted": counts["corrupted"],
        "lost": sum(counts[kind] for kind in LOST_FATES),
        "recovery_s": event.recovery_s, "memory_before_mib": event.memory_before_mib,
        "memory_after_mib": event.memory_after_mib, "lost_examples": lost_examples,
    }


def totals(rows: list[dict], memory_start_mib: float, memory_end_mib: float) -> dict:
    """The whole run: sums over the faults, the slowest recovery and the memory growth."""
    keys = ("sent", "completed", "refused", "cancelled", "failed", "duplicated", "truncated", "corrupted", "lost")
    summed = {key: sum(row[key] for row in rows) for key in keys}
    recoveries = [row["recovery_s"] for row in rows if row["name"] != "none"]
    summed["max_recovery_s"] = None if any(r is None for r in recoveries) else max(recoveries, default=0.0)
    summed["memory_start_mib"] = memory_start_mib
    summed["memory_end_mib"] = memory_end_mib
    summed["memory_growth"] = memory_end_mib / memory_start_mib - 1.0 if memory_start_mib > 0 else None
    return summed
