"""Token ids to text deltas for streaming: no half characters, and stop strings cut out (pure).

Decoding each token alone breaks multi-byte characters and merged spaces, and decoding
the whole output after each token costs O(n^2) over an answer. So only a short window is
decoded: the tokens since the last settled text plus the ones before them as context,
and the new text is what the window adds to its context. Text that ends in half a
character waits for the next token. With stop strings, the last few characters are held
back until they cannot start one; the text ends before the first match (after it with
`include_stop`, vLLM's include_stop_str_in_output), and `matched_stop` names it.
"""

from collections.abc import Sequence


class TextStream:
    """Turns a growing list of output token ids into the text deltas a client receives.

    Args:
        tokenizer: a Hugging Face tokenizer (`decode`).
        stop: stop strings; the text ends before the first one and never shows it...
        include_stop: ...or, with this, ends with it.
        skip_special_tokens: leave special tokens (an end of turn, say) out of the text, as vLLM does by default.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.matched_stop: str | None = None  # the stop string that ended the text
        self._longest_stop = max((len(s) for s in self.stop), default=1)
        self.token_ids: list[int] = []
        self._decoded = ""  # the output's settled text, sent or not
        self._num_sent = 0  # characters of it sent so far
        self._context_from = 0  # token where the decoding window starts (context before the new tokens)
        self._new_from = 0  # first token whose text is not settled yet
        self._cut_at: int | None = None  # end of the text once a stop string was found
        self._match_at: int | None = None  # where that stop string starts

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._decoded[: self._num_sent]

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that can be sent now."""
        self.token_ids.extend(token_ids)
        if self._cut_at is not None:
            return ""
        self._settle(final=False)
        if self._cut_at is not None:
            return self._advance(self._cut_at)
        return self._advance(max(len(self._decoded) - (self._longest_stop - 1), self._num_sent))

    def finish(self, is_stop: bool = False) -> str:
        """The rest of the text once the request ended (`is_stop`: it stopped on EOS or a stop string)."""
        if self._cut_at is None:
            self._settle(final=True)
        return self._advance(len(self._decoded) if self._cut_at is None else self._cut_at)

    def _settle(self, final: bool) -> None:
        """Decode the window and take its new text, unless it ends in half a character (and more may come)."""
        context = self._decode(self.token_ids[self._context_from:self._new_from])
        window = self._decode(self.token_ids[self._context_from:])
        if len(window) <= len(context) or (window.endswith("\ufffd") and not final):
            return
        searched_from = max(0, len(self._decoded) - (self._longest_stop - 1))  # a stop may span the old end
        self._decoded += window[len(context):]
        self._context_from, self._new_from = self._new_from, len(self.token_ids)
        for stop in self.stop:
            at = self._decoded.find(stop, searched_from)
            if at != -1 and (self._match_at is None or at < self._match_at):
                self._match_at, self.matched_stop = at, stop
        if self._match_at is not None:
            self._cut_at = self._match_at + (len(self.matched_stop) if self.include_stop else 0)

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of spaces (" ." -> "."): it would make a window's text differ from its context's plus the new.
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _advance(self, upto: int) -> str:
        if upto <= self._num_sent:
            return ""
        delta = self._decoded[self._num_sent:upto]
        self._num_sent = upto
        return delta
