"""A tool-calling answer as it streams (pure): the text besides the calls as content, and each call as OpenAI
streams one, read in the answer's format as the text comes.

    {"index": i, "id": "call_...", "type": "function", "function": {"name": "f", "arguments": ""}}   once f is known
    {"index": i, "function": {"arguments": "{\\"city\\": \\"Pa"}}                                    then fragments

A reader per format gives, for the text so far, the content so far and each call so far as (name, arguments so far);
both only ever grow, so the stream sends what is new. What is held back: a tail that may be the start of a call's
tag, content that is only whitespace so far (an answer of calls alone has none), and everything of an answer that
opens as a Llama call. At the end `finish` brings the stream to the whole answer's reading
(`cluster.ingress.tool_calls.calls_of`): what is missing is sent; a call the model broke after its start was streamed
stays as sent (as vLLM's parsers leave it), while the whole answer reads it as text.
"""

import re
import uuid

from cluster.ingress.json_members import ObjectScanner
from cluster.ingress.tool_parsers import (LLAMA_TAG, MISTRAL_TAG, QWEN_PARAMETER, call_so_far, object_call,
                                          qwen_arguments, qwen_call, qwen_member)

CallSoFar = tuple[str, str]  # the name, the arguments' text so far
_CALL_START, _CALL_END = "<tool_call>", "</tool_call>"
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>")


def _held_back(text: str, start: int, marker: str) -> int:
    """Where content may end in `text[start:]`: before a tail that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - size:]):
            return len(text) - size
    return len(text)


def _find_from(text: str, marker: str, start: int, end: int | None = None) -> tuple[int, int]:
    """(where `marker` is in `text[start:end]`, or -1; where to look again once the text grew)."""
    end = len(text) if end is None else end
    at = text.find(marker, start, end)
    return at, at if at >= 0 else max(start, end - len(marker) + 1)


class _Tagged:
    """Hermes' and Qwen3-Coder's: calls inside <tool_call> tags, content around them. Each read goes on from where
    the last stopped (an answer of 40,000 characters reads in linear time)."""

    def __init__(self, is_qwen: bool) -> None:
        self._is_qwen = is_qwen
        self._pos = 0  # read up to here
        self._content = ""
        self._calls: list[CallSoFar] = []
        self.broken: set[int] = set()  # indices of calls sent before they proved no call (the whole answer lacks them)
        self._body_start: int | None = None  # inside a call's tags, its body's start
        self._close_from = 0  # where to look for the call's closing tag
        self._reported = False  # the open call was in a reading: it keeps its index whatever it turns out to be
        self._last: CallSoFar = ("", "")  # the open call as last read
        self._scanner: ObjectScanner | None = None
        self._function: str | None = None  # Qwen3-Coder: the open call's function, its parameters so far, and
        self._members: list[str] = []  # where the next parameter starts and its closing tag is looked for
        self._parameter_from = self._parameter_close_from = 0

    def read(self, text: str) -> tuple[str, list[CallSoFar]]:
        while True:
            if self._body_start is None:
                at = text.find(_CALL_START, self._pos)
                if at < 0:
                    end = _held_back(text, self._pos, _CALL_START)
                    self._content += text[self._pos:end]
                    self._pos = end
                    return self._content, self._calls
                self._content += text[self._pos:at]
                self._open_call(at + len(_CALL_START))
            close, self._close_from = _find_from(text, _CALL_END, self._close_from)
            current = self._body(text, len(text) if close < 0 else close, is_closed=close >= 0)
            if close < 0:
                self._reported = self._reported or current is not None
                return self._content, self._calls + ([current] if current is not None else [])
            block = text[self._body_start - len(_CALL_START):close + len(_CALL_END)]
            if current is None:  # a broken call is no call: its text is the answer's, as the whole answer reads it
                self._content += block
                if self._reported:  # sent already: it keeps its place, so the next call's index is the next one
                    self.broken.add(len(self._calls))
                    self._calls.append(self._last)
            else:
                self._calls.append(current)
            self._pos, self._body_start = close + len(_CALL_END), None

    def _open_call(self, body_start: int) -> None:
        self._pos = self._body_start = self._close_from = body_start
        self._reported, self._last = False, ("", "")
        self._scanner = None if self._is_qwen else ObjectScanner(body_start)
        self._function, self._members = None, []

    def _body(self, text: str, body_end: int, is_closed: bool) -> CallSoFar | None:
        if self._is_qwen:
            current = self._qwen_body(text, body_end, is_closed)
        elif is_closed:
            current = object_call(text[self._body_start:body_end])
        else:
            self._scanner.feed(text)
            current = None if self._scanner.broken else call_so_far(text, self._scanner)
        if current is not None:
            self._last = current
        return current

    def _qwen_body(self, text: str, body_end: int, is_closed: bool) -> CallSoFar | None:
        if is_closed:  # the block is whole: read as the whole answer reads it
            return qwen_call(text[self._body_start:body_end])
        if self._function is None:
            function = _QWEN_FUNCTION.match(text, self._body_start, body_end)
            if function is None:
                return None
            self._function = function.group(1)
            self._parameter_from = self._parameter_close_from = function.end()
        while True:  # each parameter once, as its closing tag comes
            close, self._parameter_close_from = _find_from(text, "</parameter>", self._parameter_close_from, body_end)
            if close < 0:
                break
            end = close + len("</parameter>")
            parameter = QWEN_PARAMETER.search(text, self._parameter_from, end)
            if parameter is not None:
                self._members.append(qwen_member(*parameter.groups()))
            self._parameter_from = self._parameter_close_from = end
        return self._function, qwen_arguments(self._members, is_closed=False)  # its "}" comes with </tool_call>


class _Objects:
    """Call objects one after another: Llama 3's (after an optional <|python_tag|>, joined by ";"), Mistral's after
    [TOOL_CALLS] (a JSON list of them, or v11's name{arguments}, each after its own tag), or the object (or list
    of them) a "required" call's grammar writes."""

    _SEPARATORS = {"llama3_json": " \t\r\n;", "required": " \t\r\n,[", "mistral": " \t\r\n,["}

    def __init__(self, format_name: str) -> None:
        self._format = format_name  # llama3_json, mistral or required; "text" once a Llama answer proved text
        self._pos: int | None = 0 if format_name == "required" else None  # where the next call may start
        self._is_v11: bool | None = None if format_name == "mistral" else False  # Mistral's name{arguments}
        self._content = ""
        self._calls: list[CallSoFar] = []
        self._scanner: ObjectScanner | None = None
        self._name: str | None = None  # v11: the name before the object, which is the arguments
        self._object_start = 0
        self._tag_from = 0  # Mistral: where to look for [TOOL_CALLS]

    def read(self, text: str) -> tuple[str, list[CallSoFar]]:
        if self._format == "text":
            return text, []
        if self._pos is None and not self._find_calls(text):
            return self._content, self._calls
        while self._scanner is not None or self._next_object(text):
            self._scanner.feed(text)
            if self._name is not None:
                current = self._name, text[self._object_start:self._scanner.end or len(text)]
            else:
                current = call_so_far(text, self._scanner)
            if self._scanner.broken or self._scanner.end is None:
                return self._content, self._calls + ([current] if current and not self._scanner.broken else [])
            if current is not None:
                self._calls.append(current)
            self._pos, self._scanner, self._name = self._scanner.end, None, None
        return self._content, self._calls

    def _find_calls(self, text: str) -> bool:
        """Whether the calls' start is known (then `_pos` is set); the content before it meanwhile."""
        if self._format == "mistral":
            at, self._tag_from = _find_from(text, MISTRAL_TAG, self._tag_from)
            if at < 0:
                self._content = text[:_held_back(text, 0, MISTRAL_TAG)]
                return False
            self._content, self._pos = text[:at], at + len(MISTRAL_TAG)
            return True
        opening = text.lstrip()
        if opening.startswith(LLAMA_TAG):
            opening = opening[len(LLAMA_TAG):].lstrip()
        elif LLAMA_TAG.startswith(opening):
            return False  # nothing yet, or perhaps the tag
        if not opening:
            return False
        if not opening.startswith("{"):
            self._format = "text"  # a text answer: content, all of it
            self._content = text
            return False
        self._pos = len(text) - len(opening)
        return True

    def _next_object(self, text: str) -> bool:
        """Moves to the next call's object once its start has come."""
        at = self._pos
        if self._is_v11 is None:  # Mistral's: a list, or v11's
            head = text[at:].lstrip()
            if not head:
                return False
            self._is_v11 = not head.startswith("[")
        if self._is_v11:
            rest = text[at:].lstrip()
            if MISTRAL_TAG.startswith(rest) and rest != MISTRAL_TAG:
                return False  # nothing yet, or perhaps the next call's tag
            rest = rest.removeprefix(MISTRAL_TAG)
            brace = rest.find("{")
            if brace < 0 or not rest[:brace].strip():
                return False
            self._name = rest[:brace].strip()
            at = len(text) - len(rest) + brace
        else:
            rest = text[at:]
            at += len(rest) - len(rest.lstrip(self._SEPARATORS[self._format]))
        if at >= len(text) or text[at] != "{":
            return False
        self._object_start = at
        self._scanner = ObjectScanner(at)
        return True


class _Named:
    """A call to the function the request named: the whole answer is its arguments."""

    def __init__(self, name: str) -> None:
        self._name = name

    def read(self, text: str) -> tuple[str, list[CallSoFar]]:
        return "", [(self._name, text)]


class ToolCallStream:
    """What to send of one choice's content as it comes, under a tool_choice of "auto" (read by `parser`),
    "required" or a function's name; `max_calls` 1 under parallel_tool_calls false."""

    def __init__(self, choice: str, parser: str | None, max_calls: int | None = None) -> None:
        if choice == "auto":
            parser = parser or "hermes"
            self._reader = (_Tagged(parser == "qwen3_coder") if parser in ("hermes", "qwen3_coder")
                            else _Objects(parser))
        else:
            self._reader = _Objects("required") if choice == "required" else _Named(choice)
        self._max_calls = max_calls
        self._text = ""
        self._content_sent = ""
        self._sent: list[str] = []  # each call's arguments sent so far

    def push(self, delta: str) -> tuple[str, list[dict]]:
        """The content to send (perhaps "") and the calls' deltas (perhaps none) for one content delta."""
        self._text += delta
        content, calls = self._reader.read(self._text)
        if not self._content_sent and not content.strip():
            content = ""  # only whitespace so far, which an answer of calls alone does not send
        return self._content_delta(content), self._call_deltas(calls)

    def finish(self, calls: list[dict] | None, content: str | None) -> tuple[str, list[dict]]:
        """What is still to send, once the answer is whole: `calls` its OpenAI tool_calls, `content` its content
        (the text besides the calls, or all of it when it has none)."""
        content_delta = self._content_delta(content or "")
        broken = getattr(self._reader, "broken", set())  # the whole answer's calls fill the other places
        places = [index for index in range(len(self._sent) + len(calls or ())) if index not in broken]
        return content_delta, self._call_deltas([(call["function"]["name"], call["function"]["arguments"])
                                                 for call in calls or ()], [call["id"] for call in calls or ()],
                                                places)

    def _content_delta(self, content: str) -> str:
        """What is new in `content` after what was sent ("" where the two differ: a call the model broke)."""
        if not content.startswith(self._content_sent):
            return ""
        delta = content[len(self._content_sent):]
        self._content_sent = content
        return delta

    def _call_deltas(self, calls: list[CallSoFar], ids: list[str] | None = None,
                     places: list[int] | None = None) -> list[dict]:
        """Deltas for the calls so far; `places`, each call's index in the stream (its position by default)."""
        deltas = []
        for position, (name, arguments) in enumerate(calls[:self._max_calls]):
            index = position if places is None else places[position]
            if index >= len(self._sent):
                call_id = ids[position] if ids else f"call_{uuid.uuid4().hex[:24]}"
                deltas.append({"index": index, "id": call_id, "type": "function",
                               "function": {"name": name, "arguments": arguments}})
                self._sent.append(arguments)
            elif arguments.startswith(self._sent[index]) and len(arguments) > len(self._sent[index]):
                deltas.append({"index": index, "function": {"arguments": arguments[len(self._sent[index]):]}})
                self._sent[index] = arguments
        return deltas
