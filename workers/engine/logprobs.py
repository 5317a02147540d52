"""Log-probabilities a step hands out: of sampled tokens (`logprobs`) and of prompt tokens (`prompt_logprobs`).

Both read the model's raw distribution, log-softmax of the logits in float32 before bias, penalties and
temperature (what vLLM reports by default and what a scoring harness compares across models). Each is one
batched log-softmax, gather and top-k over the rows that ask, whatever their number: the rows that do not ask
cost nothing.

Prompt scoring: the logits at prompt position p score prompt token p + 1, so a sequence that asks has every
prompt position but the last kept by the forward (`PromptScores`), and the first prompt token has no logprob.
"""

from dataclasses import dataclass

import torch

from workers.values.sequence import Sequence
from workers.values.step_output import TokenLogprob

SCORE_BLOCK_ROWS = 1024  # prompt rows log-softmaxed at once


@dataclass(frozen=True, slots=True)
class PromptScores:
    """Logits of the prompt positions one step scored.

    Attributes:
        logits: [S, vocab], the spans' rows in order.
        spans: (sequence, first prompt position scored, number of positions) per scoring sequence.
    """

    logits: torch.Tensor
    spans: tuple[tuple[Sequence, int, int], ...]


def scored_positions(seq: Sequence, start: int, end: int) -> range:
    """The positions of chunk [start, end) whose logits score one of seq's prompt tokens not scored yet."""
    if seq.prompt_logprobs is None:
        return range(0)
    first = max(start, len(seq.prompt_logprobs))  # a recomputed chunk scores nothing twice
    return range(first, min(end, seq.num_prompt_tokens - 1))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], counts: list[int]) -> list[TokenLogprob]:
    """logits [R, vocab] (any dtype); per row the logprob of token_ids[r] and the counts[r] most likely tokens."""
    rows = logits.float().log_softmax(dim=-1)  # [R, vocab]
    chosen = rows.gather(1, torch.tensor(token_ids, device=rows.device)[:, None])[:, 0].tolist()  # [R]
    k = max(counts, default=0)
    if k == 0:
        return [TokenLogprob(token, value) for token, value in zip(token_ids, chosen)]
    top_values, top_ids = (t.tolist() for t in rows.topk(k, dim=-1))  # [R, k] each, most likely first
    return [TokenLogprob(token, value, tuple(zip(top_ids[r][:count], top_values[r][:count])))
            for r, (token, value, count) in enumerate(zip(token_ids, chosen, counts))]


def score_prompts(scores: PromptScores) -> list[TokenLogprob]:
    """The scored prompt tokens' logprobs, the spans' in order; SCORE_BLOCK_ROWS rows at a time, so that a long
    prefill chunk of a large vocabulary never needs more than one block's float32 copy."""
    targets, counts = [], []
    for seq, first, num in scores.spans:
        targets.extend(seq.prompt_token_ids[first + 1:first + 1 + num])
        counts.extend([seq.params.prompt_logprobs] * num)
    return [logprob for start in range(0, len(targets), SCORE_BLOCK_ROWS)
            for logprob in token_logprobs(scores.logits[start:start + SCORE_BLOCK_ROWS],
                                          targets[start:start + SCORE_BLOCK_ROWS],
                                          counts[start:start + SCORE_BLOCK_ROWS])]


def record_prompt_scores(scores: PromptScores, scored: list[TokenLogprob]) -> None:
    """Append `score_prompts`' answer to each sequence's `prompt_logprobs` (once the step's progress counts)."""
    row = 0
    for seq, first, num in scores.spans:
        assert len(seq.prompt_logprobs) == first, (seq.seq_id, len(seq.prompt_logprobs), first)
        seq.prompt_logprobs.extend(scored[row:row + num])
        row += num


def take_prompt_logprobs(seq: Sequence) -> tuple[TokenLogprob | None, ...] | None:
    """The whole prompt's logprobs (None for the first token) once, with the sequence's first output token."""
    if seq.prompt_logprobs is None or len(seq.prompt_logprobs) < seq.num_prompt_tokens - 1:
        return None
    whole = (None, *seq.prompt_logprobs)
    seq.prompt_logprobs = None
    return whole


def split_scores(logits: torch.Tensor, hidden: torch.Tensor | None, sampling_chunks: list,
                 spans: list[tuple[Sequence, int, int]]) -> tuple:
    """A forward's logits [N + S, vocab] -> (the N sampled rows, hidden, sampling_chunks, PromptScores or None)."""
    num_sampling = len(sampling_chunks)
    scores = PromptScores(logits[num_sampling:], tuple(spans)) if spans else None
    return logits[:num_sampling], hidden, sampling_chunks, scores


def sampled_logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprob | None]:
    """Per row of the step's logits [N, vocab] (as the model gave them): the sampled token's logprob where the
    row's sequence asks for logprobs, else None."""
    rows = [r for r, seq in enumerate(seqs) if seq.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if rows:
        picked = token_logprobs(logits.index_select(0, torch.tensor(rows, device=logits.device)),
                                [token_ids[r] for r in rows], [seqs[r].params.logprobs for r in rows])
        for row, logprob in zip(rows, picked):
            out[row] = logprob
    return out
