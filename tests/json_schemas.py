"""Seeded JSON schemas for structured-output tests: nested objects, enums, arrays, bounded numbers and strings,
required subsets; bounded everywhere, so that every answer ends well within a test's token limit."""

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema of 1-4 properties (nested objects to depth 2), additionalProperties false."""
    names = rng.sample(["id", "name", "city", "score", "tags", "active", "level", "owner", "size", "kind"],
                       rng.randint(1, 4))
    properties = {name: _value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def _value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "yes", "no"], rng.randint(2, 4))}
    if kind == "array":
        items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]},
                            {"type": "string", "maxLength": 6}])
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)
