"""A setting: declared once, with its default, unit and description, in the settings tree of the layer that uses it.

The tree is nested frozen dataclasses: the worker's `WorkerSettings` holds the engine's `EngineConfig`, which
holds the scheduler's `SchedulerConfig` and the cache's `CacheConfig`; each layer is handed its own part. A leaf's
name is unique in the whole tree, so a flat mapping of names (a YAML file, flags, the service's config, whose
worker settings are generated from this tree) says where each value goes. Pure: no torch, Ray or pydantic.
"""

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def setting(default: Any = MISSING, description: str = "", *, unit: str | None = None, flag: str | None = None,
            choices: tuple[str, ...] | None = None, internal: bool = False, factory: Any = MISSING) -> Any:
    """A dataclass field declared as a setting.

    Args:
        default: its value when nobody sets it.
        description: what it does, for `--help`, the service's config and the configuration reference.
        unit: what its number counts (tokens, bytes, seconds), where it is a quantity.
        flag: the command-line flag when it is not `--` and the name with dashes.
        choices: the values it may take, where they are a fixed few.
        internal: derived or meant for tests (a sized budget, a tiny model's seed): not a user's setting, so not
            in the service's config.
        factory: a nested part of the tree (its dataclass), instead of a default.
    """
    metadata = {"description": description, "unit": unit, "flag": flag, "choices": choices, "internal": internal}
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One setting of a tree: its field, the class that declares it and the parts above it."""

    field: dataclasses.Field
    owner: type
    path: tuple[str, ...]  # the nested parts' field names from the root, then its own name

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def default(self) -> Any:
        if self.field.default is not MISSING:
            return self.field.default
        return self.field.default_factory()  # type: ignore[misc]

    @property
    def description(self) -> str:
        return self.field.metadata.get("description", "")

    @property
    def unit(self) -> str | None:
        return self.field.metadata.get("unit")

    @property
    def flag(self) -> str:
        return flag_of(self.name, self.field.metadata.get("flag"))

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.field.metadata.get("choices")

    @property
    def internal(self) -> bool:
        return bool(self.field.metadata.get("internal"))


def flag_of(name: str, flag: str | None = None) -> str:
    """A setting's command-line flag: the one its declaration names, else `--` and its name with dashes."""
    return flag or "--" + name.replace("_", "-")


def is_part(field: dataclasses.Field) -> bool:
    """Whether a field is a nested part of the tree (a settings dataclass) rather than a setting."""
    return isinstance(field.type, type) and dataclasses.is_dataclass(field.type)


def leaves(tree: type, path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every setting of `tree`, depth first, nested parts included."""
    for field in dataclasses.fields(tree):
        if is_part(field):
            yield from leaves(field.type, (*path, field.name))
        else:
            yield Leaf(field, tree, (*path, field.name))


def build(tree: type[T], values: Mapping[str, Any]) -> T:
    """`tree` with `values` (settings by leaf name, any depth) and the defaults for the rest.

    Raises ValueError naming a value no leaf of `tree` takes, or what a part's checks refuse.
    """
    unknown = set(values) - {leaf.name for leaf in leaves(tree)}
    if unknown:
        raise ValueError(f"{tree.__name__} has no setting {', '.join(sorted(unknown))}")
    return _build(tree, values)


def _build(tree: type[T], values: Mapping[str, Any]) -> T:
    kwargs = {}
    for field in dataclasses.fields(tree):
        if is_part(field):
            kwargs[field.name] = _build(field.type, values)
        elif field.name in values:
            kwargs[field.name] = values[field.name]
    return tree(**kwargs)


def flat(settings: Any) -> dict[str, Any]:
    """The settings of a built tree by leaf name (what `build` takes back)."""
    values = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        values.update(flat(value) if is_part(field) else {field.name: value})
    return values


class SettingsTree:
    """Base of a settings dataclass: `of` builds it from leaf names at any depth, e.g.
    `EngineConfig.of(kv_cache_bytes=2**26, max_num_seqs=4)` sets the scheduler's max_num_seqs; `updated` changes
    them in a built one."""

    __slots__ = ()

    @classmethod
    def of(cls: type[T], **values: Any) -> T:
        return build(cls, values)

    def updated(self: T, **values: Any) -> T:
        """This tree with `values` (leaf names at any depth) changed, as `dataclasses.replace` for the top level."""
        return build(type(self), {**flat(self), **values})
