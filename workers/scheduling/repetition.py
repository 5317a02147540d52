"""Whether an answer repeats itself: what decoding reveals about its remaining length that the prompt did not.

Half of SmolLM2's greedy answers run to max_tokens, most of them by looping over a phrase
or a paragraph. Once the last `LOOP_NGRAM_TOKENS` tokens have occurred earlier in the
answer, greedy decoding is very likely to go round the same loop until the limit, so a
scheduler ranking remaining work (`workers.scheduling.length_distribution`) treats such an answer as
one that will run to max_tokens. The engine asks every `LOOP_CHECK_EVERY` tokens; each ask
is one byte search over the answer (C speed, no Python loop over tokens). Pure.
"""

from array import array
from collections.abc import Sequence as TokenIds

from workers.values.sequence import Sequence

LOOP_NGRAM_TOKENS = 16
LOOP_CHECK_EVERY = 16


def repeats_itself(token_ids: TokenIds[int], ngram_tokens: int = LOOP_NGRAM_TOKENS) -> bool:
    """The last `ngram_tokens` tokens of `token_ids` occurred earlier in it (overlapping allowed)."""
    if ngram_tokens < 1:
        raise ValueError(f"ngram_tokens must be >= 1, got {ngram_tokens}")
    if len(token_ids) <= ngram_tokens:
        return False
    packed = array("q", token_ids).tobytes()
    width = array("q").itemsize
    tail = packed[-ngram_tokens * width:]
    end = len(packed) - width  # an earlier occurrence starts before the tail does
    start = packed.find(tail, 0, end)
    while start != -1:
        if start % width == 0:  # aligned on a token, not inside one
            return True
        start = packed.find(tail, start + 1, end)
    return False


def flag_loop(seq: Sequence) -> None:
    """Mark `seq` as looping once its answer repeats itself; a forced length is known, so nothing to reveal."""
    if not seq.is_looping and seq.params.forced_output_tokens is None:
        seq.is_looping = repeats_itself(seq.output_token_ids)
