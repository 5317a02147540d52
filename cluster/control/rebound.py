"""Reservations re-planned by the bounds a worker's length probe refined.

A worker with a length probe re-estimates a sequence's output bound from its own hidden
states after the prefill and every few dozen decoded tokens. The controller reserved the
request's KV by the router's first bound; `rebounded_records` gives the ledger records to
write so that it plans by the worker's bound instead, with the policy's `placement_tokens`
rule (its `planned_tokens`, the rule the worker uses, unless the worker admits by its own test).
Pure: records and reports in, records out.
"""

from collections.abc import Callable, Container, Iterator
from dataclasses import replace

from cluster.control.messages import RequestRecord
from cluster.control.placement import blocks_for
from workers.values.work_types import WorkerStats

# (num_prompt_tokens, num_output_tokens, max_tokens, predicted_output_tokens) -> planned total tokens
PlannedTokens = Callable[[int, int, int, int | None], int]


def rebounded_records(stats: WorkerStats, record_of: Callable[[str], RequestRecord | None],
                      planned_tokens: PlannedTokens, block_size: int, largest_cache_blocks: int,
                      moving: Container[str] = ()) -> Iterator[RequestRecord]:
    """Ledger records of this worker's requests whose bound the worker changed, re-planned by that bound.

    A request is left alone when the ledger does not place it on this worker (it finished,
    moved or is being moved) or its bound is the one already planned with. The reservation
    is the policy's plan, never less than what the worker holds for the request (blocks it
    has not given back, or an overrun's growth), clamped to
    [1, largest_cache_blocks] as a placement is. A generator: each record is looked up as
    it is yielded, so a caller that writes one before asking for the next never writes
    back a record that changed meanwhile.
    """
    for report in stats.rebounded:
        record = record_of(report.request_id)
        if (record is None or record.worker_id != stats.worker_id or record.state != "placed"
                or report.request_id in moving or record.predicted_output_tokens == report.predicted_output_tokens):
            continue
        tokens = planned_tokens(record.num_prompt_tokens, report.num_output_tokens, record.max_tokens,
                                report.predicted_output_tokens)
        num_blocks = blocks_for(max(tokens, report.num_reserved_tokens), block_size)
        yield replace(record, predicted_output_tokens=report.predicted_output_tokens,
                      num_reserved_blocks=max(1, min(num_blocks, largest_cache_blocks)))
