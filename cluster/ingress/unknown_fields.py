"""Fields of a request body that its model does not declare: named, never dropped without a word.

The generation endpoints' models ignore fields they do not declare (the official clients send
a few that have no use here, and newer clients send fields before we declare them), so the
router names them: the response carries `x-s3-ignored-fields` with their names, each router
replica logs a name the first time it sees it, and with `strict_request_fields` they are a 400.
A nested field is named by its path: `stream_options.foo`, `messages[].foo`,
`tools[].function.foo`.
"""

import types
import typing
from typing import Any

from pydantic import BaseModel

IGNORED_FIELDS_HEADER = "x-s3-ignored-fields"
MAX_HEADER_NAMES = 16  # names a header lists; "+N more" stands for the rest
MAX_NAME_CHARS = 64  # a longer name, or one with characters a header cannot carry, is counted, not shown
MAX_LOGGED_NAMES = 256  # distinct names a replica logs; beyond them, new names are no longer logged


def unknown_fields(payload: Any, model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    """The paths of `payload`'s keys that `model_cls` (and the models of its fields, within lists and unions) does not
    declare, sorted; nothing for a payload that is not an object (validation refuses those)."""
    if not isinstance(payload, dict):
        return []
    declared = {**{name: field for name, field in model_cls.model_fields.items()},
                **{field.alias: field for field in model_cls.model_fields.values() if field.alias}}
    found = set()
    for key, value in payload.items():
        field = declared.get(key)
        if field is None:
            found.add(f"{prefix}{key}")
            continue
        for model, in_list in _models_in(field.annotation):
            if in_list and isinstance(value, list):
                for item in value:
                    found.update(unknown_fields(item, model, f"{prefix}{key}[]."))
            elif not in_list:
                found.update(unknown_fields(value, model, f"{prefix}{key}."))
    return sorted(found)


def _models_in(annotation: Any, in_list: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The pydantic models an annotation admits (through Annotated, unions, Optional and list), each with whether it
    sits inside a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, in_list)]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0], in_list)
    if origin in (typing.Union, types.UnionType):
        return [found for arg in typing.get_args(annotation) for found in _models_in(arg, in_list)]
    if origin is list:
        return [found for arg in typing.get_args(annotation) for found in _models_in(arg, True)]
    return []


def header_value(names: list[str]) -> str:
    """`names` as a header can carry them: printable ASCII names of at most `MAX_NAME_CHARS`, at most
    `MAX_HEADER_NAMES` of them, then "+N more" for the rest (a client's keys are echoed, never raw)."""
    shown = [name for name in names if _showable(name)]
    listed = shown[:MAX_HEADER_NAMES]
    rest = len(names) - len(listed)
    return ", ".join(listed + ([f"+{rest} more"] if rest else []))


class UnknownFieldLog:
    """The unknown field names a router replica has already logged (each is logged once, however often it comes,
    and at most `MAX_LOGGED_NAMES` of them)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def first_seen(self, names: list[str]) -> list[str]:
        """Those of `names` not seen before, now remembered (none once `MAX_LOGGED_NAMES` were)."""
        new = [name for name in dict.fromkeys(names) if name not in self.seen][:MAX_LOGGED_NAMES - len(self.seen)]
        self.seen.update(new)
        return [name if _showable(name) else f"(a name of {len(name)} characters, not shown)" for name in new]


def _showable(name: str) -> bool:
    return len(name) <= MAX_NAME_CHARS and name.isascii() and name.isprintable()
