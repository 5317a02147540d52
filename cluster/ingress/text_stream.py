"""Token ids to text deltas for streaming: no half characters, and stop strings cut out (pure).

Decoding each token alone breaks multi-byte characters and merged spaces, so the
whole output is decoded each time and only the new, settled suffix goes out. With
stop strings, the last few characters are held back until they cannot start one.
"""

from collections.abc import Sequence


class TextStream:
    """Turns a growing list of output token ids into the text deltas a client receives.

    Args:
        tokenizer: a Hugging Face tokenizer (`decode`).
        stop: stop strings; the text ends before the first one and never shows it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._hold_chars = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # everything sent so far
        self._cut_at: int | None = None  # end of the text once a stop string was found

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that can be sent now."""
        self.token_ids.extend(token_ids)
        if self._cut_at is not None:
            return ""
        full = self._decoded()
        for stop in self.stop:
            at = full.find(stop)
            if at != -1 and (self._cut_at is None or at < self._cut_at):
                self._cut_at = at
        if self._cut_at is not None:
            return self._advance(full[: self._cut_at])
        settled = full.rstrip("\ufffd")  # an incomplete character decodes to U+FFFD
        if self._hold_chars:
            settled = settled[: max(len(settled) - self._hold_chars, len(self.text))]
        return self._advance(settled)

    def finish(self, is_stop: bool = False) -> str:
        """The rest of the text once the request ended (`is_stop`: it stopped on EOS or a stop string)."""
        full = self._decoded()
        if self._cut_at is not None:
            full = full[: self._cut_at]
        return self._advance(full)

    def _advance(self, upto: str) -> str:
        if not upto.startswith(self.text) or len(upto) <= len(self.text):
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta
