"""A reasoning model's thinking apart from its answer: the think tags, as vLLM's `--reasoning-parser` names them.

- `qwen3`: the model opens `<think>` itself (after nothing but whitespace), thinks, closes `</think>`, then
  answers. Text that does not open with the tag is all answer (Qwen3 with thinking off writes no thinking).
- `deepseek_r1`: the chat template opens the think block in the prompt, so the answer text starts inside it: the
  reasoning, `</think>`, then the answer. An opening tag the model writes too is dropped.

Under both, an answer cut before `</think>` (by max_tokens) is all reasoning, streamed or not. A stream is split as
it comes: the end of a delta that could be the start of a tag waits for the next delta (pure).
"""

REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


class ReasoningStream:
    """Splits an answer's text deltas into (reasoning, content) deltas.

    Args:
        parser: one of `REASONING_PARSERS`.
    """

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(REASONING_PARSERS)}")
        self.parser = parser
        # "open": before the text shows whether a think block opens; "reasoning"; "content".
        self._state = "open" if parser == "qwen3" else "reasoning"
        self._may_open = True  # deepseek_r1: a leading opening tag is still possible (dropped)
        self._held = ""
        self.has_block = parser == "deepseek_r1"  # whether the answer has a think block (qwen3: once it opens one)

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) text of this delta, what may be a tag's start held back."""
        self._held += delta
        reasoning, content = [], []
        while self._held:
            if self._state == "open":
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN_TAG):
                    self._held, self._state = stripped[len(OPEN_TAG):], "reasoning"
                    self._may_open, self.has_block = False, True
                elif OPEN_TAG.startswith(stripped):
                    break  # whitespace or the tag's start: wait
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                if self._may_open:
                    if self._held.startswith(OPEN_TAG):
                        self._held = self._held[len(OPEN_TAG):]
                    elif OPEN_TAG.startswith(self._held):
                        break
                    self._may_open = False
                    continue
                end = self._held.find(CLOSE_TAG)
                if end >= 0:
                    reasoning.append(self._held[:end])
                    self._held, self._state = self._held[end + len(CLOSE_TAG):], "content"
                    continue
                keep = _partial_tag_length(self._held, CLOSE_TAG)
                reasoning.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            else:
                content.append(self._held)
                self._held = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) text held back when the answer ended: in a think block it is reasoning."""
        held, self._held = self._held, ""
        return (held, "") if self._state == "reasoning" else ("", held)


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """A whole answer as (reasoning, content): exactly what its stream's deltas join to; reasoning None when the
    answer has no think block (qwen3's answers without one)."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.push(text)
    tail_reasoning, tail_content = stream.finish()
    return (reasoning + tail_reasoning if stream.has_block else None), content + tail_content


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (what must wait for more text)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0
