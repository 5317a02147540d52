"""The batched sampler: one token per row of logits, each request with its own settings and generator."""

from collections.abc import Callable

import torch

from kv_kernels import reference
from workers.engine.grammar_masks import mask_disallowed
from workers.engine.logit_adjustments import adjust_logits
from workers.values.sampling_params import SamplingParams


class Sampler:
    """Picks one token per row of logits, each row with its own settings and generator.

    First each row's bias, bans and penalties (`workers.engine.logit_adjustments`; untouched
    logits when no row has any). Greedy rows share one argmax over the logits as they
    come (bf16 included: the argmax of exactly upcast values is the same). Sampled rows
    are processed as one batch (temperature, top-k, min-p, top-p, cumulative sums);
    each still draws its uniform number from its own generator, so a request's tokens
    do not depend on its neighbours.

    Args:
        eos_token_ids: the model's end tokens, which min_tokens bans.
        row_argmax: logits [N, V] -> the index of each row's largest [N] (the first of equals); the kernel
            backend's (`kv_kernels.backend.KVKernelBackend.row_argmax`).
    """

    def __init__(self, eos_token_ids: frozenset[int] = frozenset(),
                 row_argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._generators: dict[object, torch.Generator] = {}
        self.eos_token_ids = eos_token_ids
        self.row_argmax = row_argmax or reference.row_argmax

    def sample(self, logits: torch.Tensor, seq_ids: list, params: list[SamplingParams],
               histories: list[tuple[list[int], list[int]]] | None = None,
               allowed: tuple[list[int], torch.Tensor] | None = None) -> list[int]:
        """Sample from logits [num_seqs, vocab_size]; returns one token id per row. `histories`: each row's
        (prompt token ids, output token ids), which the penalties and min_tokens read (None: no row has any).
        `allowed`: structured output's rows and their token bitmask (`workers.engine.grammar_masks`), applied last."""
        raw = logits
        if histories is not None:
            logits = adjust_logits(logits, params, histories, self.eos_token_ids)
        if allowed is not None:
            logits = _masked(raw, logits, allowed, [params[row] for row in allowed[0]])
        token_ids = self.row_argmax(logits).tolist()
        sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            picks = self._sample_rows(logits, sampled_rows, [seq_ids[r] for r in sampled_rows],
                                      [params[r] for r in sampled_rows])
            for row, token in zip(sampled_rows, picks):
                token_ids[row] = token
        return token_ids

    def forget(self, seq_id) -> None:
        """Drop a finished sequence's generator."""
        self._generators.pop(seq_id, None)

    def _generator(self, seq_id, seed: int | None) -> torch.Generator:
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator()
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
            self._generators[seq_id] = generator
        return generator

    def _sample_rows(self, logits: torch.Tensor, rows: list[int], seq_ids: list, params: list[SamplingParams]) -> list[int]:
        index = torch.tensor(rows, device=logits.device)
        temperatures = torch.tensor([p.temperature for p in params], device=logits.device)[:, None]
        probs = torch.softmax(logits.index_select(0, index).float() / temperatures, dim=-1).cpu()  # [N, V]
        # Inverse-CDF sampling over probabilities sorted high to low; top-p zeroes the tail
        # whose preceding mass already reaches p (the top token always survives).
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True)
        if any(p.truncates for p in params):
            sorted_probs = _truncate(sorted_probs, params)
        top_p = torch.tensor([p.top_p for p in params])[:, None]
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(mass_before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        cdf = torch.cumsum(sorted_probs, dim=-1)  # [N, V]
        draws = torch.cat([torch.rand(1, generator=self._generator(seq_id, p.seed)) for seq_id, p in zip(seq_ids, params)])
        picks = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True)[:, 0]  # [N]
        picks = torch.minimum(picks, (sorted_probs > 0).sum(dim=-1) - 1)  # float rounding at the top end
        return sorted_ids.gather(1, picks[:, None])[:, 0].tolist()


def _truncate(sorted_probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k and min-p on probabilities sorted high to low [N, V]: zero what they drop, then renormalise, so top-p
    reads the mass of what is left (vLLM's order)."""
    vocab = sorted_probs.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]  # [N, 1]
    min_p = torch.tensor([p.min_p for p in params], dtype=sorted_probs.dtype)[:, None]  # [N, 1]
    keep = (torch.arange(vocab)[None] < top_k) & (sorted_probs >= min_p * sorted_probs[:, :1])  # [N, V]
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _masked(raw: torch.Tensor, adjusted: torch.Tensor, allowed: tuple[list[int], torch.Tensor],
            params: list[SamplingParams]) -> torch.Tensor:
    """The adjusted logits [N, V] with each constrained row's disallowed tokens at -inf. A row whose bans
    (min_tokens' EOS and stop ids) leave its grammar no token takes the grammar's mask over its raw logits instead:
    the grammar wins, and one request can never leave a row with nothing to pick (NaN in the whole step)."""
    rows, bitmask = allowed
    out = mask_disallowed(adjusted, rows, bitmask)
    banned = [i for i, p in enumerate(params) if p.adjusts_logits]  # only bans put -inf before the mask
    if not banned:
        return out
    index = torch.tensor([rows[i] for i in banned], device=out.device)
    empty = torch.isneginf(out.index_select(0, index)).all(dim=-1).tolist()  # [B]
    dead = [i for i, is_empty in zip(banned, empty) if is_empty]
    if dead:
        fallback = mask_disallowed(raw, [rows[i] for i in dead], bitmask[dead])
        for i in dead:
            out[rows[i]] = fallback[rows[i]]
    return out
