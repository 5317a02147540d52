"""What a request's settings do to its row of logits before a token is picked, for every row of a step at once.

In vLLM's order:

    logit_bias            OpenAI's: add each (token, bias) to that token's logit
    min_tokens            before that many output tokens, EOS (unless ignore_eos) and stop_token_ids are banned
    repetition_penalty    vLLM's and Hugging Face's: a token of the prompt or the output has its logit divided by
                          the penalty when positive and multiplied by it when negative
    frequency, presence   OpenAI's: logit -= frequency * (times the output holds the token) + presence * (holds it)

Temperature, top-k, top-p and min-p come after, in the sampler. Rows that ask for none of these cost nothing: a
step where no row does gets its logits back untouched. The others are handled together: each adjustment is one
scatter into the flattened [N * V] logits, its indices built from the rows' token lists (one list per row, the
token-level work in torch).
"""

import torch

from workers.values.sampling_params import SamplingParams


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  histories: list[tuple[list[int], list[int]]], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """logits [N, V] -> the same tensor when no row adjusts, else a float32 copy [N, V] with each row adjusted.

    Args:
        params: each row's settings.
        histories: each row's (prompt token ids, output token ids), read only.
        eos_token_ids: the model's end tokens (min_tokens bans them).
    """
    rows = [row for row, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.to(torch.float32, copy=True)  # [N, V]
    flat = out.view(-1)  # [N * V], row r's token t at r * V + t
    vocab = out.shape[1]
    device = out.device

    def positions(pairs: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Flat indices of (row, token ids) pairs."""
        parts = [torch.tensor(tokens, dtype=torch.long) + row * vocab for row, tokens in pairs if tokens]
        return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.long, device=device)

    biased = [(row, params[row].logit_bias) for row in rows if params[row].logit_bias]
    if biased:
        index = positions([(row, [token for token, _ in bias]) for row, bias in biased])
        values = torch.tensor([value for _, bias in biased for _, value in bias], dtype=torch.float32, device=device)
        flat.index_add_(0, index, values)
    banned = []
    for row in rows:
        p, output = params[row], histories[row][1]
        if len(output) < p.min_tokens:
            banned.append((row, sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids)))))
    if banned:
        flat[positions(banned)] = float("-inf")
    repeated = [row for row in rows if params[row].repetition_penalty != 1.0]
    if repeated:
        index = torch.unique(positions([(row, histories[row][0] + histories[row][1]) for row in repeated]))
        penalty = _per_row([p.repetition_penalty for p in params], device)[index // vocab]
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [row for row in rows if params[row].presence_penalty or params[row].frequency_penalty]
    if counted:
        index, counts = torch.unique(positions([(row, histories[row][1]) for row in counted]), return_counts=True)
        row_of = index // vocab
        frequency = _per_row([p.frequency_penalty for p in params], device)[row_of]
        presence = _per_row([p.presence_penalty for p in params], device)[row_of]
        flat.index_add_(0, index, -(frequency * counts + presence))
    return out


def _per_row(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)  # [N]
