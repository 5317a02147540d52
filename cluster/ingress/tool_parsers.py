"""The tool-call formats models write when they may call tools ("auto"), read as vLLM's `--tool-call-parser` names them.

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any number (Hermes, Qwen 2.5 and 3)
    llama3_json   {"name": "f", "parameters": {...}} as the answer, several joined by ";", after an optional
                  <|python_tag|> (Llama 3.1 to 3.3)
    mistral       [TOOL_CALLS] then a JSON list of {"name", "arguments"} (v3 tokenizers) or name{...} pairs (v11)
    qwen3_coder   <tool_call><function=f><parameter=p>value</parameter>...</function></tool_call> (Qwen3-Coder;
                  a value is JSON where it parses, else text)

Each parser gives the calls an answer holds, as (name, arguments) pairs, and the text besides them (pure). The
arguments are the JSON text the model wrote (built from the parameters for qwen3_coder), so that what a stream sent
as it came (`cluster.ingress.tool_call_stream`) joins to the same text.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.ingress.json_members import ObjectScanner, scan_object

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# A Qwen3-Coder block's body: the function, its parameters up to the last </function> (a value may hold one).
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*)</function>\s*", re.DOTALL)
QWEN_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
LLAMA_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"

Call = tuple[str, str]  # the function's name, its arguments' JSON text


@dataclass(frozen=True, slots=True)
class ToolParser:
    """One format: `calls(text)` (None when the answer holds none), `besides(text)` (the answer's other text, None
    when there is none), and `marker`, a string whose presence in a chat template shows the format."""

    name: str
    marker: str
    calls: Callable[[str], list[Call] | None]
    besides: Callable[[str], str | None]


def call_so_far(text: str, scanner: ObjectScanner) -> Call | None:
    """A call object's name and arguments so far, as `scanner` has read `text`: once its name is read; its arguments
    while an object or list comes (any other value once closed, "{}" when the object closed without them)."""
    name = scanner.closed_value(text, "name")
    try:
        name = None if name is None else json.loads(name)
    except json.JSONDecodeError:  # a bad escape or a raw control character: no call
        return None
    if not isinstance(name, str):
        return None
    key = "arguments" if "arguments" in scanner.members else "parameters"
    arguments = scanner.value(text, key)
    if arguments is None:
        return name, "{}" if scanner.end is not None else ""
    is_open = scanner.members[key][1] is None
    return name, arguments if not is_open or arguments[:1] in ("{", "[") else ""


def object_call(block: str) -> Call | None:
    """The call a JSON object's text holds: {"name": ..., "arguments" (Llama's "parameters"): {...}}, its arguments
    as written ("{}" when it has none); None when the text is no such object."""
    value = _json(block)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = scan_object(block).closed_value(block, "arguments" if "arguments" in value else "parameters")
    return value["name"], "{}" if arguments is None else arguments


def qwen_member(name: str, value: str) -> str:
    """One Qwen3-Coder parameter as a JSON object's member: "name": value, the value JSON where it parses, else
    text (non-ASCII as it is, unless it holds a lone surrogate, which no UTF-8 stream can carry)."""
    parsed = _json(value)
    value = value if parsed is None else parsed
    member = f"{json.dumps(name, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
    try:
        member.encode("utf-8")
    except UnicodeEncodeError:
        member = f"{json.dumps(name)}: {json.dumps(value)}"
    return member


def qwen_arguments(members: list[str], is_closed: bool = True) -> str:
    """Qwen3-Coder's parameters (`qwen_member`s) as a JSON object's text; with `is_closed` false, the text so far of
    an object that may have more ("" before its first parameter)."""
    if not is_closed:
        return "{" + ", ".join(members) if members else ""
    return "{" + ", ".join(members) + "}"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _hermes_calls(text: str) -> list[Call] | None:
    calls = [call for block in _HERMES.findall(text) if (call := object_call(block)) is not None]
    return calls or None


def _hermes_besides(text: str) -> str | None:
    """The text outside the calls; a block that holds no call stays, as Qwen3-Coder's parser keeps its."""
    return _text(_HERMES.sub(lambda block: "" if object_call(block.group(1)) is not None else block.group(0), text))


def _text(besides: str) -> str | None:
    """The text besides the calls as the model wrote it (as vLLM's parsers give it); None when it is only
    whitespace."""
    return besides if besides.strip() else None


def _llama_calls(text: str) -> list[Call] | None:
    body = text.strip().removeprefix(LLAMA_TAG).strip()
    if not body.startswith("{"):
        return None
    calls = [object_call(part) for part in _split_top_level(body, ";")]
    return calls if calls and all(call is not None for call in calls) else None


def _llama_besides(text: str) -> str | None:
    return None if _llama_calls(text) is not None else _text(text)


def _mistral_calls(text: str) -> list[Call] | None:
    at = text.find(MISTRAL_TAG)
    if at < 0:
        return None
    body = text[at + len(MISTRAL_TAG):].strip()
    if isinstance(_json(body), list):
        calls = [object_call(item) for item in list_items(body)]
        return calls if calls and all(call is not None for call in calls) else None
    calls = []
    for part in body.split(MISTRAL_TAG):  # v11: name{arguments}, each after its own tag
        name, brace, arguments = part.strip().partition("{")
        parsed = _json(brace + arguments) if brace else None
        if not name.strip() or not isinstance(parsed, dict):
            return None
        calls.append((name.strip(), (brace + arguments).strip()))
    return calls or None


def _mistral_besides(text: str) -> str | None:
    return _text(text.split(MISTRAL_TAG, 1)[0])


def qwen_call(body: str) -> Call | None:
    """The call one <tool_call> block's body holds in Qwen3-Coder's format, None when it holds none."""
    function = _QWEN_FUNCTION.fullmatch(body)
    if function is None:
        return None
    name, parameters = function.groups()
    return name, qwen_arguments([qwen_member(*parameter) for parameter in QWEN_PARAMETER.findall(parameters)])


def _qwen_calls(text: str) -> list[Call] | None:
    calls = [call for body in _TOOL_CALL_BLOCK.findall(text) if (call := qwen_call(body)) is not None]
    return calls or None


def _qwen_besides(text: str) -> str | None:
    return _text(_TOOL_CALL_BLOCK.sub(lambda block: "" if qwen_call(block.group(1)) is not None else block.group(0),
                                      text))


def list_items(body: str) -> list[str]:
    """The texts of the items of a JSON list of objects, from its "[" on; an item that is not a whole object (cut
    short, or no object) is the rest of the text, last."""
    items, at = [], body.index("[") + 1
    while True:
        at += len(body[at:]) - len(body[at:].lstrip(" \t\r\n,"))
        if at >= len(body) or body[at] == "]":
            return items
        scanner = scan_object(body, at)
        if scanner.end is None:  # an item that is not an object: the caller's parse refuses it
            return [*items, body[at:]]
        items.append(body[at:scanner.end])
        at = scanner.end


def _split_top_level(text: str, separator: str) -> list[str]:
    """`text` split at `separator`s outside JSON strings and brackets."""
    parts, depth, in_string, escaped, start = [], 0, False, False, 0
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [part for part in parts if part]


TOOL_PARSERS = {parser.name: parser for parser in (
    ToolParser("hermes", "<tool_call>", _hermes_calls, _hermes_besides),
    ToolParser("llama3_json", "<|python_tag|>", _llama_calls, _llama_besides),
    ToolParser("mistral", MISTRAL_TAG, _mistral_calls, _mistral_besides),
    ToolParser("qwen3_coder", "<function=", _qwen_calls, _qwen_besides),
)}
TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)


def parser_for(configured: str | None, template: str) -> ToolParser | None:
    """The configured parser, or without one the hermes parser when the template writes Hermes' tags (the format
    read before parsers could be chosen); None when neither applies."""
    if configured is not None:
        return TOOL_PARSERS[configured]
    return TOOL_PARSERS["hermes"] if "<tool_call>" in template and "<function=" not in template else None
