"""Flags generated from declared settings: the service's config for `s3serve serve`, tree leaves for the benches.

Every flag's name, type, choices, help and default come from the one declaration of its setting
(`cluster.config`, `workers.values.setting`); a flag left out is None, so the config file or the default stands.
"""

import argparse
import types
import typing

from workers.values.setting import flag_of, leaves

if typing.TYPE_CHECKING:  # pydantic only where the service runs: the benches run where it is missing
    from pydantic import BaseModel


def _value_type(annotation) -> type | None:
    """The type a flag's text converts to: int, float or str (from `X | None` too); None for a tuple or a bool."""
    if annotation in (int, float, str):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) == 1:
            return _value_type(args[0])
        return str  # `str | int`: the text, parsed by the setting's own check
    return None


def _add(parser: argparse.ArgumentParser, name: str, annotation, default, description: str, unit: str | None,
         flag: str, choices, repeat: bool = False) -> None:
    shown = "none" if default is None else ("off" if default is False else "on" if default is True else default)
    notes = [unit] if unit else []
    if "default" not in description:
        notes.append(f"default: {shown}")
    text = f"{description} ({'; '.join(notes)})" if notes else description
    kwargs: dict = {"dest": name, "default": None, "help": text.replace("%", "%%")}
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif repeat:
        kwargs |= {"action": "append", "metavar": name.upper().removesuffix("S")}
    elif _value_type(annotation) is None:  # a tuple of names
        kwargs |= {"nargs": "+", "metavar": name.upper().removesuffix("S")}
    else:
        kwargs["type"] = _value_type(annotation)
        kwargs["metavar"] = {int: "N", float: "X"}.get(kwargs["type"], name.upper())
        if choices:
            kwargs |= {"choices": choices, "metavar": None}
    parser.add_argument(flag, **kwargs)


def add_config_flags(parser: argparse.ArgumentParser, config: "type[BaseModel]", names) -> None:
    """One flag per named field of a pydantic config (its json_schema_extra may name the flag, its unit and
    choices)."""
    for name in names:
        info = config.model_fields[name]
        extra = info.json_schema_extra or {}
        _add(parser, name, info.annotation, info.default, info.description or "", extra.get("unit"),
             flag_of(name, extra.get("flag")), extra.get("choices"), bool(extra.get("repeat")))


def add_setting_flags(parser: argparse.ArgumentParser, tree: type, names: tuple[str, ...]) -> None:
    """Flags for the named leaves of a settings tree: what a bench lets its user set on the engines it runs."""
    by_name = {leaf.name: leaf for leaf in leaves(tree)}
    for name in names:
        leaf = by_name[name]
        _add(parser, name, leaf.field.type, leaf.default, leaf.description, leaf.unit, leaf.flag, leaf.choices)


def given_values(args: argparse.Namespace, names) -> dict:
    """The settings among `names` whose flag was given, lists as tuples."""
    values = {}
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            values[name] = tuple(value) if isinstance(value, list) else value
    return values
