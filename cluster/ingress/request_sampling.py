"""A validated request's sampling settings, checked against the context and the vocabulary: the engine's
`SamplingParams`, or a 400 naming the field (pure: no Serve, no Ray)."""

from cluster.ingress import openai_protocol as protocol
from cluster.ingress.errors import bad_request, prompt_too_long
from cluster.ingress.structured_request import grammar_spec
from workers.values.sampling_params import SamplingParams

# request field -> SamplingParams field, each passed only when the request sets it
_EXTRAS = ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")


def sampling_params(req, num_prompt_tokens: int, is_chat: bool, max_model_len: int, default_max_tokens: int | None,
                    vocab_size: int, skip_special_tokens: bool = True) -> SamplingParams:
    """`req` (a Completion or ChatCompletion request) as SamplingParams, max_tokens the rest of the context when
    neither the request nor `default_max_tokens` sets it; APIError (400) for what cannot be served:
    a prompt that fills the context, max_tokens past it, forced or minimum lengths past max_tokens, token ids
    outside the vocabulary. max_tokens 0 (completions with echo: score the prompt) is 1 here; the answer drops
    the token."""
    if num_prompt_tokens >= max_model_len:
        raise prompt_too_long(num_prompt_tokens, max_model_len, "messages" if is_chat else "prompt")
    max_tokens = protocol.requested_max_tokens(req)
    if max_tokens is None:
        room = max_model_len - num_prompt_tokens
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if num_prompt_tokens + max_tokens > max_model_len:
        raise bad_request(
            f"max_tokens {max_tokens} + prompt of {num_prompt_tokens} tokens exceeds the context of {max_model_len} "
            f"tokens; lower max_tokens to at most {max_model_len - num_prompt_tokens}", "max_tokens")
    forced = req.forced_output_tokens
    if forced is not None and forced > max_tokens:
        raise bad_request(f"forced_output_tokens {forced} exceeds max_tokens {max_tokens}", "forced_output_tokens")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens {req.min_tokens} exceeds max_tokens {max_tokens}", "min_tokens")
    for field, tokens in (("logit_bias", [token for token, _ in req.logit_bias_pairs]),
                          ("stop_token_ids", req.stop_token_ids or [])):
        if any(token >= vocab_size for token in tokens):
            raise bad_request(f"{field} names token ids outside the vocabulary of {vocab_size} tokens", field)
    extras = {name: getattr(req, name) for name in _EXTRAS if getattr(req, name) is not None}
    extras.update(_logprobs(req, is_chat))
    grammar = grammar_spec(req)
    return SamplingParams(max_tokens=max(max_tokens, 1), temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                          stop=req.stop_sequences, ignore_eos=req.ignore_eos, forced_output_tokens=forced,
                          stop_token_ids=tuple(req.stop_token_ids or ()), logit_bias=req.logit_bias_pairs,
                          grammar=grammar, skip_special_tokens=skip_special_tokens, **extras)


def _logprobs(req, is_chat: bool) -> dict:
    """The logprob counts the engine computes: for the answer (chat: top_logprobs when logprobs is true; completions:
    logprobs, and at least 0 when best_of ranks the candidates by their logprobs) and for the prompt (vLLM's
    prompt_logprobs, and with echo, logprobs: the larger)."""
    prompt = {} if req.prompt_logprobs is None else {"prompt_logprobs": req.prompt_logprobs}  # vLLM's
    if is_chat:
        return ({"logprobs": req.top_logprobs or 0} if req.logprobs else {}) | prompt
    answer = req.logprobs
    if answer is None and req.best_of is not None and req.best_of > req.n:
        answer = 0
    extras = {} if answer is None else {"logprobs": answer}
    if req.echo and req.logprobs is not None:
        prompt = {"prompt_logprobs": max(req.logprobs, prompt.get("prompt_logprobs", 0))}
    return extras | prompt
