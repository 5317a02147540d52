"""Token logprobs in OpenAI's two response forms (pure: a tokenizer is passed in).

Completions (legacy):  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}, ...],
                        "text_offset": [...]}; a token without a logprob (the first prompt token under echo)
                        has None in both lists. As OpenAI documents, the sampled token is always in its
                        `top_logprobs` entry, so an entry holds up to logprobs + 1 tokens.
Chat:                  {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                        "bytes"}]}]}, exactly top_logprobs alternatives each.

vLLM's `prompt_logprobs` (`vllm_prompt_logprobs`): one entry per prompt token, None for the first (nothing
predicts it), else {token id: {"logprob", "rank", "decoded_token"}} for the prompt's token and the most likely
alternatives; `rank` is the place in the distribution, 1 the most likely, None for a prompt token outside the
alternatives returned (the engine does not rank the whole vocabulary).

A token's text is that token decoded alone (a piece of a multi-byte character reads as U+FFFD, and `bytes`
then holds that replacement's UTF-8, as vLLM's do).
"""

from collections.abc import Sequence

from workers.values.step_output import TokenLogprob


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class CompletionLogprobs:
    """The completion form, built up as tokens come; `text_offset` counts characters from `start_offset`."""

    def __init__(self, tokenizer, start_offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._offset = start_offset

    def entries(self, logprobs: Sequence[TokenLogprob | None], token_ids: Sequence[int]) -> dict:
        """The form for these tokens (each with its logprob, or None), offsets continuing from the last call's."""
        body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob in zip(token_ids, logprobs):
            text = token_text(self._tokenizer, token_id)
            body["tokens"].append(text)
            body["text_offset"].append(self._offset)
            self._offset += len(text)
            if logprob is None:
                body["token_logprobs"].append(None)
                body["top_logprobs"].append(None)
                continue
            body["token_logprobs"].append(logprob.logprob)
            top = {token_text(self._tokenizer, alternative): value for alternative, value in logprob.top}
            top.setdefault(text, logprob.logprob)
            body["top_logprobs"].append(top)
        return body


def join_completion_logprobs(parts: Sequence[dict]) -> dict:
    """Consecutive `CompletionLogprobs.entries` as one (echo: the prompt's, then the answer's)."""
    return {key: [item for part in parts for item in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def chat_logprobs(tokenizer, logprobs: Sequence[TokenLogprob]) -> dict:
    """The chat form of answer tokens' logprobs."""
    return {"content": [dict(_chat_token(tokenizer, logprob.token_id, logprob.logprob),
                             top_logprobs=[_chat_token(tokenizer, token_id, value) for token_id, value in logprob.top])
                        for logprob in logprobs]}


def vllm_prompt_logprobs(tokenizer, logprobs: Sequence[TokenLogprob | None], token_ids: Sequence[int]) -> list:
    """The prompt's logprobs in vLLM's form (above)."""
    entries = []
    for token_id, logprob in zip(token_ids, logprobs):
        if logprob is None:
            entries.append(None)
            continue
        ranks = {alternative: rank for rank, (alternative, _) in enumerate(logprob.top, start=1)}
        entry = {str(alternative): {"logprob": value, "rank": rank, "decoded_token": token_text(tokenizer, alternative)}
                 for rank, (alternative, value) in enumerate(logprob.top, start=1)}
        entry.setdefault(str(token_id), {"logprob": logprob.logprob, "rank": ranks.get(token_id),
                                         "decoded_token": token_text(tokenizer, token_id)})
        entries.append(entry)
    return entries


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
