"""What an engine refuses at `add_request`, before anything changes: ValueError naming the reason."""

from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.values.sampling_params import SamplingParams


def check_request(prompt: list[int], params: SamplingParams, resumed: list[int], vocab_size: int, max_model_len: int,
                  allocator: BlockAllocator, kv_cache_bytes: int, has_tokenizer: bool) -> None:
    """A request this engine can never serve: its tokens, its length against the context and the KV pool."""
    if not prompt:
        raise ValueError("prompt is empty: at least one token is required")
    if any(not 0 <= token < vocab_size for token in prompt):
        raise ValueError(f"prompt token ids must lie in [0, {vocab_size})")
    named = [*params.stop_token_ids, *(token for token, _ in params.logit_bias)]
    if any(token >= vocab_size for token in named):
        raise ValueError(f"stop_token_ids and logit_bias name token ids outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens but the context holds {max_model_len} "
            "(prompt plus at least one generated token)"
        )
    if len(prompt) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds the context of "
            f"{max_model_len} tokens; lower max_tokens to at most {max_model_len - len(prompt)}"
        )
    needed_blocks = allocator.blocks_for(len(prompt) + params.max_tokens)
    if needed_blocks > allocator.num_blocks:
        raise ValueError(
            f"request needs {needed_blocks} KV blocks ({len(prompt)} prompt + {params.max_tokens} max_tokens) "
            f"but kv_cache_bytes={kv_cache_bytes} holds only {allocator.num_blocks} blocks"
        )
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need an engine built with a tokenizer")
    if any(not 0 <= token < vocab_size for token in resumed):
        raise ValueError(f"resumed output token ids must lie in [0, {vocab_size})")
    limit = params.max_tokens if params.forced_output_tokens is None else params.forced_output_tokens
    if len(resumed) >= limit:
        raise ValueError(f"{len(resumed)} resumed output tokens leave nothing to generate (limit {limit})")


def check_plan(predicted_output_tokens: int | None, priority: int) -> None:
    """The planning values that come with a request: a predicted bound and a priority class."""
    if predicted_output_tokens is not None and (
        isinstance(predicted_output_tokens, bool)
        or not isinstance(predicted_output_tokens, int)
        or predicted_output_tokens < 1
    ):
        raise ValueError(f"predicted_output_tokens must be an integer >= 1 or None, got {predicted_output_tokens!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer (lower is more urgent), got {priority!r}")
