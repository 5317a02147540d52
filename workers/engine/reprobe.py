"""The engine's step asks the length probe to re-bound the sequences it is due to read (torch: hidden states)."""

import torch

from workers.scheduling.length_probe import LengthProbe, ProbeQuery, refined_bound, remaining_for
from workers.scheduling.scheduler import Scheduler
from workers.values.sequence import Sequence


def reprobe(probe: LengthProbe, scheduler: Scheduler, seqs: list[Sequence], hidden: torch.Tensor) -> int:
    """Re-bound the sequences of this step the probe is due to read (hidden: [len(seqs), hidden_size]): each
    gets its new bound (planned by the scheduler's policy's choice of estimate) as its prediction and its plan,
    and a policy that holds its plan gives back what the new bound does not need. Returns the sequences read."""
    due = [i for i, seq in enumerate(seqs)
           if (seq.params.forced_output_tokens is None or probe.reads_forced) and probe.is_due(seq.num_output_tokens)
           and seq.num_output_tokens < seq.params.max_tokens]
    if not due:
        return 0
    queries = [ProbeQuery(seqs[i].seq_id, seqs[i].num_prompt_tokens, seqs[i].num_output_tokens,
                          seqs[i].params.max_tokens) for i in due]
    rows = hidden.index_select(0, torch.tensor(due, device=hidden.device)).float()  # [len(due), hidden_size]
    holds_plan = scheduler.policy.holds_plan
    estimates = probe.estimate_remaining(rows, queries)
    for i, query, estimate in zip(due, queries, estimates, strict=True):
        if estimate is None:  # no answer (a probe that only records): the bound stays
            continue
        seqs[i].predicted_output_tokens = refined_bound(query, remaining_for(estimate, holds_plan),
                                                        seqs[i].predicted_output_tokens)
        seqs[i].predicted_center_tokens = seqs[i].predicted_output_tokens
        seqs[i].num_probe_reads += 1
        scheduler.trim(seqs[i])  # s3 gives back what the new bound does not need
    return len(due)
