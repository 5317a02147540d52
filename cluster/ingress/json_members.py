"""Where a JSON object's top-level members lie in its text, read as the text grows (pure).

A tool call streams its arguments before the object that holds them is complete, so the reader cannot wait for
`json.loads`. `ObjectScanner` follows strings, escapes and nesting one character at a time, from where it stopped,
and records each top-level member's value as a span of the text:

    {"name": "weather", "arguments": {"city": "Pa      <- the text so far
                        ^ members["arguments"] = [start, None]: open, the text from start on is its value so far

Nothing is parsed or validated beyond that: a caller that needs the value parses the closed span (`json.loads`), and
a text that cannot be an object sets `broken`.
"""

import json

_VALUE_OPENERS = "{["


class ObjectScanner:
    """One JSON object's members, from `start` in a text that is fed again (whole) each time it grows.

    Attributes:
        members: key -> [value start, value end (None while the value is still coming)], in the text's indices.
        end: the index just after the object's closing brace, None before it.
        broken: the text is not a JSON object (nothing more is read).
    """

    def __init__(self, start: int = 0) -> None:
        self.members: dict[str, list] = {}
        self.end: int | None = None
        self.broken = False
        self._pos = start  # the next character to read
        self._open = ""  # the brackets open now, outermost first: "{" then the nested ones
        # open, key, in_key, colon, value, in_string (a member's string), nested (a member's object or list),
        # nested_string (a string inside that), scalar (a number or literal), after (a member ended)
        self._state = "open"
        self._escaped = False
        self._key_start = 0
        self._key = ""

    @property
    def is_done(self) -> bool:
        return self.end is not None or self.broken

    def feed(self, text: str) -> None:
        """Reads `text` on from where the last call stopped (the text only ever grows)."""
        while self._pos < len(text) and not self.is_done:
            self._read(text, self._pos)
            self._pos += 1

    def value(self, text: str, key: str) -> str | None:
        """The text of `key`'s value so far (its whole text once closed), None before it started."""
        span = self.members.get(key)
        if span is None:
            return None
        return text[span[0]:self._pos if span[1] is None else span[1]]

    def closed_value(self, text: str, key: str) -> str | None:
        """The text of `key`'s value once it is closed, else None."""
        span = self.members.get(key)
        return None if span is None or span[1] is None else text[span[0]:span[1]]

    def _read(self, text: str, i: int) -> None:
        char = text[i]
        if self._state in ("in_key", "in_string", "nested_string"):
            self._read_string(text, i, char)
            return
        if self._state == "scalar" and len(self._open) == 1 and (char in ",}" or char.isspace()):
            self._close_value(i)
        if char.isspace():
            return
        if char == '"':
            self._open_string(i)
        elif char in _VALUE_OPENERS:
            self._open_nested(i, char)
        elif char in "}]":
            self._close_nested(i, char)
        elif len(self._open) == 1:
            self._read_punctuation(i, char)
        elif not self._open:  # text before the object
            self.broken = True

    def _read_string(self, text: str, i: int, char: str) -> None:
        if self._escaped:
            self._escaped = False
        elif char == "\\":
            self._escaped = True
        elif char == '"':
            if self._state == "in_key":
                try:
                    self._key = json.loads(text[self._key_start:i + 1])
                except json.JSONDecodeError:  # a bad escape or a raw control character
                    self.broken = True
                    return
                self._state = "colon"
            elif self._state == "in_string":
                self._close_value(i + 1)
            else:  # a string inside a nested value ends; the value goes on
                self._state = "nested"

    def _open_string(self, i: int) -> None:
        depth = len(self._open)
        if depth > 1:
            self._state = "nested_string"
        elif depth == 1 and self._state == "key":
            self._key_start, self._state = i, "in_key"
        elif depth == 1 and self._state == "value":
            self._open_value(i)
            self._state = "in_string"
        else:
            self.broken = True

    def _open_nested(self, i: int, char: str) -> None:
        if not self._open:
            if char != "{" or self._state != "open":
                self.broken = True
                return
            self._state = "key"
        elif len(self._open) == 1:
            if self._state != "value":
                self.broken = True
                return
            self._open_value(i)
            self._state = "nested"
        self._open += char

    def _close_nested(self, i: int, char: str) -> None:
        if not self._open or _VALUE_OPENERS.index(self._open[-1]) != "}]".index(char):  # [1} is no JSON
            self.broken = True
            return
        self._open = self._open[:-1]
        if len(self._open) == 1 and self._state == "nested":
            self._close_value(i + 1)
        elif not self._open:
            if self._state not in ("key", "after"):
                self.broken = True
                return
            self.end = i + 1

    def _read_punctuation(self, i: int, char: str) -> None:
        if char == ":" and self._state == "colon":
            self._state = "value"
        elif char == "," and self._state == "after":
            self._state = "key"
        elif self._state == "value":
            self._open_value(i)
            self._state = "scalar"
        elif self._state != "scalar":
            self.broken = True

    def _open_value(self, i: int) -> None:
        self.members[self._key] = [i, None]

    def _close_value(self, end: int) -> None:
        self.members[self._key][1] = end
        self._state = "after"


def scan_object(text: str, start: int = 0) -> ObjectScanner:
    """The members of the object at `start` of a whole text."""
    scanner = ObjectScanner(start)
    scanner.feed(text)
    return scanner
