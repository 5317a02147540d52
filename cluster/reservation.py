"""How many KV tokens the controller reserves for a request on the worker it places it on (pure)."""

RESERVING_POLICIES = ("s3", "s3_peak", "max_reserve", "paged_greedy")


def reservation_tokens(policy: str, num_prompt_tokens: int, max_tokens: int, predicted_output_tokens: int | None,
                       num_resumed_tokens: int = 0) -> int:
    """Prompt plus the output room the cluster-level placement sets aside.

    `max_reserve` holds the worst case, `s3`/`s3_peak` the predictor's upper bound
    (never less than what a resumed request already produced plus one token), and
    `paged_greedy` only the prompt and the next token: it grows on demand inside
    the worker and preempts there, the vLLM way.
    """
    if policy not in RESERVING_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(RESERVING_POLICIES)}")
    if num_prompt_tokens < 1 or max_tokens < 1:
        raise ValueError(f"need num_prompt_tokens >= 1 and max_tokens >= 1, got {num_prompt_tokens}, {max_tokens}")
    if not 0 <= num_resumed_tokens < max_tokens:
        raise ValueError(f"num_resumed_tokens must lie in [0, max_tokens={max_tokens}), got {num_resumed_tokens}")
    if policy == "max_reserve":
        output = max_tokens
    elif policy == "paged_greedy":
        output = num_resumed_tokens + 1
    else:
        bound = predicted_output_tokens if predicted_output_tokens is not None else max_tokens
        output = min(max(bound, num_resumed_tokens + 1), max_tokens)
    return num_prompt_tokens + output
